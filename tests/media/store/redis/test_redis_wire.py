"""RespStream on a local socket pair: replies land in their buffers, copied once."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvwire.exceptions import JobAbandoned
from kvwire.media.store.base import CacheWrites
from kvwire.media.store.redis._wire import (
    SHORT_REPLY_BYTES,
    Deadline,
    DeadlineExceeded,
    RespStream,
    ZeroCopyCommandPacker,
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

    def recvmsg_into(self, buffers: list[memoryview]) -> tuple[int, list[Any], int, Any]:
        result = self._sock.recvmsg_into(buffers)
        if buffers[-1].obj is self._scratch:
            # Filled in order: what went past the other buffers landed in scratch.
            self.into_scratch += max(0, result[0] - sum(buffer.nbytes for buffer in buffers[:-1]))
        return result


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


def _split(buffer: bytearray, sizes: list[int]) -> list[memoryview]:
    """``buffer`` cut into consecutive ranges of ``sizes`` (a block's ranges in a cache)."""
    view = memoryview(buffer)
    ranges, start = [], 0
    for size in sizes:
        ranges.append(view[start : start + size])
        start += size
    return ranges


# Ranges of uneven sizes, small and large, more than fit one recvmsg_into call.
RANGE_SIZES = [7, 4096, 1, 65536 + 3, 300 * 1024] + [1000] * 600


@pytest.mark.parametrize("vectored", [True, False], ids=["recvmsg_into", "recv_into"])
def test_values_scatter_over_their_ranges_bit_exactly(
    connected: tuple[socket.socket, socket.socket], vectored: bool
) -> None:
    server, client = connected
    total = sum(RANGE_SIZES)
    values = [os.urandom(total) for _ in range(3)]
    sender = _send_in_background(server, b"".join(_bulk(value) for value in values))
    scratch = bytearray(64 * 1024)
    counting = _CountingSocket(client, scratch)
    reader = RespStream(counting, scratch, _deadline())  # type: ignore[arg-type]
    reader._vectored = vectored
    memories = [bytearray(total + 16) for _ in values]

    replies = [reader.read_into_ranges(_split(memory, RANGE_SIZES)) for memory in memories]
    sender.join()

    assert replies == [total] * len(values)
    # Every range holds its part of the value; the 16 bytes past the ranges are untouched.
    assert [bytes(memory) for memory in memories] == [value + bytes(16) for value in values]
    # Each read is armed with the deadline, but the socket's timeout is set only once.
    assert counting.timeouts_set == 1
    # Through scratch: the first header read, then each value's CRLF and the next
    # header, taken with its last range; no value's bytes are copied out of it.
    assert counting.into_scratch <= 512 + len(values) * 16


def test_a_value_longer_than_its_ranges_writes_nothing_and_a_shorter_one_nothing_past_it(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    server, client = connected
    sizes = [1000, 200 * 1024, 5000]
    total = sum(sizes)
    short, after = os.urandom(total - 3000), os.urandom(total)
    stream = (
        _bulk(os.urandom(total + 1)) + _bulk(short) + b"$-1\r\n" + b"-NOPERM no\r\n" + _bulk(after)
    )
    sender = _send_in_background(server, stream)
    reader = RespStream(client, bytearray(64 * 1024), _deadline())
    memories = [bytearray(b"\xaa" * (total + 16)) for _ in range(5)]

    replies = [reader.read_into_ranges(_split(memory, sizes)) for memory in memories]
    sender.join()

    assert replies[:3] == [RespStream.OVERSIZED, len(short), None]
    assert isinstance(replies[3], redis.exceptions.ResponseError)
    assert replies[4] == total
    untouched = b"\xaa" * (total + 16)
    assert [memories[i] for i in (0, 2, 3)] == [untouched] * 3
    # The short value fills what it covers (the caller's check rejects it), nothing past it.
    assert bytes(memories[1]) == short + untouched[len(short) :]
    # The stream stayed in step: the reply after them lands whole.
    assert bytes(memories[4]) == after + untouched[total:]


def test_a_load_given_up_mid_value_writes_nothing_more_into_its_ranges(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    server, client = connected
    # Small enough that the whole value fits in the socket's buffer.
    sizes = [4096] * 8
    total = sum(sizes)
    # The value's first half arrives; the rest once the load is given up.
    server.sendall(b"$%d\r\n" % total + b"\x01" * (total // 2))
    memory = bytearray(total)

    class _GivenUpAtHalf(CacheWrites):
        """The connector gives up on the load once its first half has landed."""

        def writing(self) -> contextlib.AbstractContextManager[None]:
            if memory[total // 2 - 1] == 1 and not self.closed:
                server.sendall(b"\x02" * (total // 2) + b"\r\n")
                self.close(grace_s=0)  # nothing is being written between two writes
            return super().writing()

    reader = RespStream(client, bytearray(64 * 1024), _deadline())

    with pytest.raises(JobAbandoned):
        reader.read_into_ranges(_split(memory, sizes), _GivenUpAtHalf())

    # The rest of the value was there to read, and not a byte of it landed.
    assert memory == b"\x01" * (total // 2) + bytes(total // 2)


@pytest.mark.parametrize("vectored", [True, False], ids=["sendmsg", "send"])
def test_a_command_with_a_ranged_value_goes_out_whole_and_in_order(
    connected: tuple[socket.socket, socket.socket], vectored: bool
) -> None:
    server, client = connected
    memory = bytearray(os.urandom(sum(RANGE_SIZES)))
    ranges = _split(memory, RANGE_SIZES)
    pieces = ZeroCopyCommandPacker().pack("SET", "key", ranges, "EX", 60)
    writer = RespStream(client, bytearray(1024), _deadline())
    writer._vectored = vectored
    expected = (
        b"*5\r\n$3\r\nSET\r\n$3\r\nkey\r\n"
        + b"$%d\r\n" % len(memory)
        + bytes(memory)
        + b"\r\n$2\r\nEX\r\n$2\r\n60\r\n"
    )
    received = bytearray()

    def receive() -> None:
        while len(received) < len(expected):
            received.extend(server.recv(1024 * 1024))

    receiver = threading.Thread(target=receive)
    receiver.start()
    # The socket buffer fills: sendmsg sends part of a piece, then the rest.
    writer.send(pieces)
    receiver.join()

    assert bytes(received) == expected
    # The ranges went out as they are: none of them was copied into a joined piece.
    assert sum(1 for piece in pieces if isinstance(piece, memoryview)) == len(RANGE_SIZES)
