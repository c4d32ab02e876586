"""RespStream on a local socket pair: replies land in their buffers, copied once."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest
import redis

from kvwire.connectors.redis_wire import (
    SHORT_REPLY_BYTES,
    Deadline,
    DeadlineExceeded,
    RespStream,
)

VALUE_BYTES = 300 * 1024


class _CountingSocket:
    """Counts the bytes received into the scratch buffer (not a target), and the timeouts set."""

    def __init__(self, sock: socket.socket, scratch: bytearray) -> None:
        self._sock = sock
        self._scratch = scratch
        self.into_scratch = 0
        self.timeouts_set = 0

    def gettimeout(self) -> float | None:
        return self._sock.gettimeout()

    def settimeout(self, timeout: float) -> None:
        self.timeouts_set += 1
        self._sock.settimeout(timeout)

    def recv_into(self, buffer: memoryview) -> int:
        received = self._sock.recv_into(buffer)
        if buffer.obj is self._scratch:
            self.into_scratch += received
        return received


@pytest.fixture
def connected() -> Iterator[tuple[socket.socket, socket.socket]]:
    server, client = socket.socketpair()
    yield server, client
    server.close()
    client.close()


def _send_in_background(sock: socket.socket, payload: bytes) -> threading.Thread:
    sender = threading.Thread(target=sock.sendall, args=(payload,))
    sender.start()
    return sender


def _deadline(seconds: float = 30.0) -> Deadline:
    return Deadline(seconds, "load_timeout_s", socket_timeout_s=10.0)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def test_values_nils_errors_and_oversized_replies_come_back_in_step(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    server, client = connected
    values = [os.urandom(VALUE_BYTES) for _ in range(3)]
    stream = (
        _bulk(values[0])
        + b"$-1\r\n"
        + _bulk(os.urandom(2 * VALUE_BYTES))  # longer than its buffer
        + b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        + _bulk(values[1])
        + _bulk(values[2])
    )
    sender = _send_in_background(server, stream)
    reader = RespStream(client, bytearray(64 * 1024), _deadline())
    targets = [memoryview(bytearray(VALUE_BYTES)) for _ in range(6)]

    replies = [reader.read_into(target) for target in targets]
    sender.join()

    assert replies[:3] == [VALUE_BYTES, None, RespStream.OVERSIZED]
    assert isinstance(replies[3], redis.exceptions.ResponseError)
    assert replies[4:] == [VALUE_BYTES, VALUE_BYTES]
    assert [targets[i].tobytes() for i in (0, 4, 5)] == values


def test_values_are_received_into_their_buffers_not_through_the_scratch_buffer(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    server, client = connected
    values = [os.urandom(VALUE_BYTES) for _ in range(8)]
    # Everything is sent before the first read, so the socket always holds
    # more than the reply being read: a greedy header read would pull the
    # next value into scratch, and it would be copied twice.
    sender = _send_in_background(server, b"".join(_bulk(value) for value in values))
    scratch = bytearray(256 * 1024)
    counting = _CountingSocket(client, scratch)
    reader = RespStream(counting, scratch, _deadline())  # type: ignore[arg-type]
    targets = [memoryview(bytearray(VALUE_BYTES)) for _ in values]

    assert [reader.read_into(target) for target in targets] == [VALUE_BYTES] * len(values)
    sender.join()

    assert [target.tobytes() for target in targets] == values
    # Headers and CRLFs, and at most a little of each value that follows one.
    assert counting.into_scratch <= len(values) * 1024


def test_the_socket_timeout_is_set_once_while_the_deadline_is_further_off(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    server, client = connected
    values = [os.urandom(VALUE_BYTES) for _ in range(4)]
    sender = _send_in_background(server, b"".join(_bulk(value) for value in values))
    scratch = bytearray(64 * 1024)
    counting = _CountingSocket(client, scratch)
    reader = RespStream(counting, scratch, _deadline())  # type: ignore[arg-type]

    for _ in values:
        assert reader.read_into(memoryview(bytearray(VALUE_BYTES))) == VALUE_BYTES
    sender.join()

    # Setting it is a system call; every read after the first finds it set already.
    assert counting.timeouts_set == 1


@pytest.mark.parametrize("header", [b"$12x\r\n", b"$\r\n", b"$99999999999999999999\r\n"])
def test_a_malformed_length_is_an_invalid_reply_not_a_value_error(
    connected: tuple[socket.socket, socket.socket], header: bytes
) -> None:
    server, client = connected
    server.sendall(header)
    stream = RespStream(client, bytearray(64 * 1024), _deadline())

    with pytest.raises(redis.exceptions.InvalidResponse, match="expected an integer"):
        stream.read_into(memoryview(bytearray(VALUE_BYTES)))


def test_a_short_reply_larger_than_the_bound_is_refused_before_it_is_read(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    server, client = connected
    # Only the header arrives: a reader that allocated and waited for the value would hang.
    server.sendall(b"$%d\r\n" % (SHORT_REPLY_BYTES + 1))
    stream = RespStream(client, bytearray(64 * 1024), _deadline())

    with pytest.raises(redis.exceptions.InvalidResponse, match="short reply"):
        stream.read_reply()


def test_a_reply_dribbled_past_the_deadline_raises_deadline_exceeded(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    server, client = connected
    server.sendall(b"$100\r\n" + b"x" * 10)  # and then nothing: a stalled server
    stream = RespStream(client, bytearray(64 * 1024), _deadline(0.2))

    with pytest.raises(DeadlineExceeded, match=r"load_timeout_s=0\.2s"):
        stream.read_into(memoryview(bytearray(VALUE_BYTES)))
