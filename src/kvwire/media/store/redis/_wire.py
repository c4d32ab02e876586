"""RESP on the wire without extra copies: commands out of, and replies into, caller buffers.

redis-py (with hiredis) copies every large value twice on the way out (to
`bytes`, then into the packed command) and, on the way in, reassembles each
reply from 64 KiB reads into a fresh `bytes` object. For KV blocks of
megabytes that is most of the cost. Here:

- `ZeroCopyCommandPacker` is given to redis-py's connections as their
  `command_packer`: a memoryview argument goes out untouched, and so does
  a list of memoryviews (a value made of byte ranges, e.g. a KV block's
  ranges in the paged cache): the ranges are never joined;
- `RespStream` sends those pieces (`sendmsg`: many pieces per
  system call) and reads the replies of a pipeline of `GET` straight from
  the connection's socket into the caller's buffers, or scattered over a
  value's byte ranges (`recvmsg_into`): each byte is copied once, from
  the kernel into the memory that keeps it. It reads the short replies of
  the other commands too.

Every socket wait of a call is bounded by the call's `Deadline`, so a
server that answers a byte at a time cannot hold a call longer than that.
Only RESP2 (the default protocol) replies are read here.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import redis

from kvwire.exceptions import DeadlineExceeded as DeadlineExceeded
from kvwire.media.store.base import CacheWrites

_CRLF = b"\r\n"

# How much a read for a reply header (or the CRLF after a value) asks for. A
# header is at most 24 bytes; what arrives beyond it is the start of the next
# value and must be copied out of the scratch buffer. A read as large as the
# scratch buffer copied up to a whole 256 KiB value twice whenever the server
# was ahead of the client.
_HEADER_READ_BYTES = 512

#: The most a short reply (to EXISTS, SET, UNLINK, SCAN, PING) may hold in all.
SHORT_REPLY_BYTES = 1024 * 1024

# SCAN's reply, [cursor, [names]], is the deepest the store asks for.
_MAX_ARRAY_DEPTH = 2
# A 64-bit integer, sign aside.
_MAX_INTEGER_DIGITS = 19

# The most pieces one sendmsg / recvmsg_into is given: Linux refuses more
# than IOV_MAX (1024) buffers per call; a call this wide already moves
# megabytes, so the rest waits for the next call.
_MAX_PIECES_PER_CALL = 512

# Around each write into a load's ranges when no CacheWrites gate is given.
_UNGATED = contextlib.nullcontext()

#: A value made of byte ranges, in order: what `ZeroCopyCommandPacker`
#: sends as one argument and `RespStream.read_into_ranges` fills.
Ranges: TypeAlias = "list[memoryview] | tuple[memoryview, ...]"

#: What `RespStream.read_reply` returns.
Reply: TypeAlias = "bytes | int | redis.exceptions.ResponseError | list[Reply] | None"


class ZeroCopyCommandPacker:
    """Encodes commands in RESP without copying large values.

    redis-py calls `pack(*args)`, and `RespStream.send` sends each
    returned piece in order. A memoryview argument is passed through
    untouched; a list (or tuple) of memoryviews is one argument, the
    concatenation of its ranges, each range passed through untouched.
    """

    # Smaller arguments are joined into one piece: fewer syscalls.
    _INLINE_LIMIT = 16 * 1024

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        # redis-py sends multi-word command names ("CONFIG GET") as one string.
        first = args[0]
        words = first.split() if isinstance(first, (str, bytes)) else [first]
        arguments = (*words, *args[1:])
        pieces: list[bytes | memoryview] = []
        head = bytearray(b"*%d\r\n" % len(arguments))
        for argument in arguments:
            value: bytes | memoryview
            if isinstance(argument, (list, tuple)):
                ranges = [_bytes_view(view) for view in argument]
                head += b"$%d\r\n" % sum(view.nbytes for view in ranges)
                pieces.append(bytes(head))
                pieces.extend(ranges)
                head = bytearray(_CRLF)
                continue
            if isinstance(argument, memoryview):
                value = _bytes_view(argument)
                length = value.nbytes
            else:
                value = _encode_small(argument)
                length = len(value)
            head += b"$%d\r\n" % length
            if length > self._INLINE_LIMIT:
                pieces.append(bytes(head))
                pieces.append(value)
                head = bytearray(_CRLF)
            else:
                head += value
                head += _CRLF
        pieces.append(bytes(head))
        return pieces


def _bytes_view(view: memoryview) -> memoryview:
    """`view` as flat bytes (a typed or shaped view of contiguous memory is cast, not copied)."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _encode_small(argument: Any) -> bytes:
    if isinstance(argument, bytes):
        return argument
    if isinstance(argument, str):
        return argument.encode()
    if isinstance(argument, bytearray):
        return bytes(argument)
    if isinstance(argument, bool):
        raise redis.exceptions.DataError("a bool is not a valid Redis argument")
    if isinstance(argument, (int, float)):
        return repr(argument).encode()
    raise redis.exceptions.DataError(f"cannot send a {type(argument).__name__} to Redis")


class Deadline:
    """When one call to the server must be over; each socket wait gets what is left of it.

    A socket timeout bounds one read or write, not a reply: a server that
    sends a byte just before each timeout would hold a call forever. Arming
    the socket with the shorter of the socket timeout and the time left
    bounds the whole call.
    """

    def __init__(self, seconds: float, setting: str, *, socket_timeout_s: float) -> None:
        self._seconds = seconds
        self._setting = setting
        self._socket_timeout_s = socket_timeout_s
        self._expires_at = time.monotonic() + seconds

    def arm(self, sock: socket.socket) -> None:
        """Let `sock`'s next wait last no longer than the socket timeout and the time left."""
        left = self._expires_at - time.monotonic()
        if left <= 0:
            raise self.exceeded()
        timeout = min(self._socket_timeout_s, left)
        # settimeout is a system call each time; while the deadline is further
        # off than the socket timeout (nearly always), the socket is armed already.
        if sock.gettimeout() != timeout:
            sock.settimeout(timeout)

    def check(self) -> None:
        """Raise `kvwire.exceptions.DeadlineExceeded` if no time is left."""
        if self.expired:
            raise self.exceeded()

    def exceeded(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"no complete reply within {self._setting}={self._seconds:g}s")

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self._expires_at


class RespStream:
    """Commands out of, and RESP2 replies into, caller buffers, on one socket, under a deadline.

    A `GET` reply goes into one buffer (`read_into`) or is scattered
    over a value's byte ranges (`read_into_ranges`).

    `scratch` holds reply headers, short replies and the bytes that arrive
    with them; it is reused across calls (one per thread). Every socket wait
    is bounded by `deadline` (see `Deadline`); past it the stream
    raises `kvwire.exceptions.DeadlineExceeded` and is out of step: the caller
    must drop the connection. Malformed replies raise `InvalidResponse`, never a bare `ValueError`.
    """

    #: `read_into`'s answer for a value longer than its buffer.
    OVERSIZED = -1

    def __init__(self, sock: socket.socket, scratch: bytearray, deadline: Deadline) -> None:
        self._sock = sock
        self._scratch = scratch
        self._view = memoryview(scratch)
        self._deadline = deadline
        self._start = 0
        self._end = 0
        self._short_reply_left = SHORT_REPLY_BYTES
        # A TLS socket has no sendmsg / recvmsg_into (Python raises
        # NotImplementedError): it sends and receives one piece at a time.
        self._vectored = not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "recvmsg_into")

    def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Send packed commands; large values go to the socket untouched.

        Each system call is armed with what is left of the deadline (a
        `sendall` gets a whole timeout per piece, and on a TLS socket per
        record). A plain socket takes many pieces per call (`sendmsg`).
        """
        if not self._vectored:
            for piece in pieces:
                self._send_one(memoryview(piece))
            return
        left = list(pieces)
        first = 0
        while first < len(left):
            self._deadline.arm(self._sock)
            try:
                sent = self._sock.sendmsg(left[first : first + _MAX_PIECES_PER_CALL])
            except TimeoutError:
                raise self._timed_out("writing to") from None
            # Skip the pieces sent whole; keep the unsent end of a piece sent in part.
            while sent:
                size = _length(left[first])
                if sent < size:
                    left[first] = memoryview(left[first])[sent:]
                    break
                sent -= size
                first += 1
            while first < len(left) and not _length(left[first]):
                first += 1

    def send_gated(
        self, commands: Sequence[Sequence[bytes | memoryview]], commit_gate: CacheWrites
    ) -> int:
        """Send commands packed one by one, each ending only while `commit_gate` is open.

        A command's last piece starts with the CRLF that ends its value
        (`ZeroCopyCommandPacker` packs a ranges value so): it goes
        out, together with the next command's pieces, only if the gate is
        open once the kernel holds every byte before it; the server runs no
        command it has not received whole. Returns how many commands went
        out whole: fewer than all leaves the connection mid-command, and the
        caller must drop it.
        """
        pending: list[bytes | memoryview] = []
        for sent, pieces in enumerate(commands):
            self.send([*pending, *pieces[:-1]])
            if not commit_gate.is_open():
                return sent
            pending = list(pieces[-1:])
        self.send(pending)
        return len(commands)

    def _send_one(self, view: memoryview) -> None:
        sent = 0
        while sent < view.nbytes:
            self._deadline.arm(self._sock)
            try:
                sent += self._sock.send(view[sent:])
            except TimeoutError:
                raise self._timed_out("writing to") from None

    def read_into(self, target: memoryview) -> int | redis.exceptions.ResponseError | None:
        """The next `GET` reply: its length (now in `target`), None for nil, or an error.

        A value longer than `target` is refused from its length, before a
        byte of it is read: it is drained through the scratch buffer (never
        held in memory) and `OVERSIZED` is returned.
        """

        def receive(length: int, header: bytes) -> None:
            self._read_exact(target[:length])
            self._expect_crlf()

        return self._read_value(target.nbytes, receive)

    def read_into_ranges(
        self, ranges: Ranges, writes: CacheWrites | None = None
    ) -> int | redis.exceptions.ResponseError | None:
        """The next `GET` reply scattered over `ranges`: its length, None for nil, or an error.

        The value's first bytes go into `ranges[0]`, the next into
        `ranges[1]`, and so on, straight from the socket (`recvmsg_into`,
        many ranges per call). A value longer than the ranges together is
        refused from its length (`OVERSIZED`) and drained through the
        scratch buffer: not a byte of it lands in the ranges. A shorter one
        fills what it covers (the caller's check rejects it). Each write into
        the ranges (a system call, or a copy of bytes already buffered) goes
        through `writes.writing()`, whose `JobAbandoned` (the load was
        given up on) propagates: nothing more is written, and the stream is
        out of step.
        """
        room = sum(view.nbytes for view in ranges)

        def receive(length: int, header: bytes) -> None:
            # The read that fills the last range (or the one for the CRLF)
            # also takes this value's CRLF and a header as long as this one:
            # the next value's, when it is as long (a run of blocks), which
            # then lands in its ranges whole, none of it through scratch.
            tail = len(header) + 4
            covered = ranges if length == room else _first_bytes(ranges, length)
            self._receive(covered, writes, tail)
            self._expect_crlf(tail)

        return self._read_value(room, receive)

    def _read_value(
        self, room: int, receive: Callable[[int, bytes], None]
    ) -> int | redis.exceptions.ResponseError | None:
        """The next `GET` reply, its value read by `receive(length, header)` if it fits in `room`.

        A longer value is drained through the scratch buffer (`OVERSIZED`).
        """
        line = self._read_line()
        kind = line[:1]
        if kind == b"$":
            length = _integer(line[1:])
            if length < 0:
                return None
            if length > room:
                self._discard(length + 2)
                return self.OVERSIZED
            receive(length, line)
            return length
        if kind == b"-":
            return redis.exceptions.ResponseError(line[1:].decode(errors="replace"))
        raise redis.exceptions.InvalidResponse(f"unexpected reply type {kind!r} to GET")

    def read_reply(self) -> Reply:
        """The next short reply: a status, an integer, a short string, nil, an error or an array.

        For the answers to `EXISTS`, `SET`, `UNLINK`, `SCAN` and
        `PING`; a reply larger than `SHORT_REPLY_BYTES` in all is
        refused rather than held in memory.
        """
        self._short_reply_left = SHORT_REPLY_BYTES
        return self._read_short(depth=0)

    def _read_short(self, depth: int) -> Reply:
        line = self._read_line()
        kind, rest = line[:1], line[1:]
        self._take_short_reply_bytes(len(line))
        if kind == b"+":
            return rest
        if kind == b":":
            return _integer(rest)
        if kind == b"-":
            return redis.exceptions.ResponseError(rest.decode(errors="replace"))
        if kind == b"$":
            length = _integer(rest)
            if length < 0:
                return None
            self._take_short_reply_bytes(length)
            value = bytearray(length)
            self._read_exact(memoryview(value))
            self._expect_crlf()
            return bytes(value)
        if kind == b"*" and depth < _MAX_ARRAY_DEPTH:
            count = _integer(rest)
            if count < 0:
                return None
            # Each element takes at least 4 bytes (":0\r\n").
            self._take_short_reply_bytes(4 * count)
            return [self._read_short(depth + 1) for _ in range(count)]
        raise redis.exceptions.InvalidResponse(f"unexpected reply type {kind!r}")

    def _take_short_reply_bytes(self, count: int) -> None:
        self._short_reply_left -= count
        if self._short_reply_left < 0:
            raise redis.exceptions.InvalidResponse(
                f"reply longer than the {SHORT_REPLY_BYTES} bytes expected of a short reply"
            )

    def _recv_into(self, target: memoryview) -> int:
        self._deadline.arm(self._sock)
        try:
            received = self._sock.recv_into(target)
        except TimeoutError:
            raise self._timed_out("reading from") from None
        if received == 0:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return received

    def _timed_out(self, doing: str) -> redis.exceptions.TimeoutError | DeadlineExceeded:
        if self._deadline.expired:
            return self._deadline.exceeded()
        return redis.exceptions.TimeoutError(f"Timeout {doing} socket")

    def _fill(self, limit: int = _HEADER_READ_BYTES) -> None:
        """Receive up to `limit` more bytes into the scratch buffer."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._scratch):
            # Move the unread tail to the front to make room.
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        self._end += self._recv_into(self._view[self._end : self._end + limit])

    def _read_line(self) -> bytes:
        while True:
            found = self._scratch.find(_CRLF, self._start, self._end)
            if found >= 0:
                line = bytes(self._view[self._start : found])
                self._start = found + 2
                return line
            if self._start == 0 and self._end == len(self._scratch):
                raise redis.exceptions.InvalidResponse("reply header longer than the buffer")
            self._fill()

    def _read_exact(self, target: memoryview) -> None:
        buffered = min(self._end - self._start, target.nbytes)
        target[:buffered] = self._view[self._start : self._start + buffered]
        self._start += buffered
        position = buffered
        while position < target.nbytes:
            position += self._recv_into(target[position:])

    def _receive(self, ranges: Ranges, writes: CacheWrites | None, tail: int) -> None:
        """Fill `ranges` in order: the bytes already buffered first, then from the socket.

        A scattered read that reaches the last range also asks for `tail`
        more bytes, into the scratch buffer.
        """
        index, offset = 0, 0
        if self._start < self._end:
            # One memory copy of at most a scratch buffer's bytes: one write.
            with _UNGATED if writes is None else writes.writing():
                while index < len(ranges) and self._start < self._end:
                    target = ranges[index]
                    taken = min(target.nbytes - offset, self._end - self._start)
                    target[offset : offset + taken] = self._view[self._start : self._start + taken]
                    self._start += taken
                    offset += taken
                    if offset == target.nbytes:
                        index, offset = index + 1, 0
        while index < len(ranges):
            with _UNGATED if writes is None else writes.writing():
                if self._vectored:
                    offset += self._recv_scattered(ranges, index, offset, tail)
                else:
                    offset += self._recv_into(ranges[index][offset:])
            # Step over the ranges the read filled.
            while index < len(ranges) and offset >= ranges[index].nbytes:
                offset -= ranges[index].nbytes
                index += 1
        if offset:
            # recvmsg_into went on past the last range into the scratch buffer
            # (the value's CRLF, and the next reply's header): keep those bytes.
            self._start, self._end = 0, offset

    def _recv_scattered(self, ranges: Ranges, index: int, offset: int, tail: int) -> int:
        """One `recvmsg_into` from `ranges[index][offset:]` on; how many bytes it received.

        The buffer is empty here. When the pieces reach the last range, the
        scratch buffer's first `tail` bytes follow it.
        """
        last = min(len(ranges), index + _MAX_PIECES_PER_CALL - 1)
        pieces = [ranges[index][offset:], *ranges[index + 1 : last]]
        if last == len(ranges):
            self._start = self._end = 0
            pieces.append(self._view[:tail])
        self._deadline.arm(self._sock)
        try:
            received = self._sock.recvmsg_into(pieces)[0]
        except TimeoutError:
            raise self._timed_out("reading from") from None
        if received == 0:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return received

    def _discard(self, count: int) -> None:
        while count > 0:
            if self._start == self._end:
                # Discarded bytes: read them in as large pieces as fit.
                self._fill(len(self._scratch))
            skipped = min(count, self._end - self._start)
            self._start += skipped
            count -= skipped

    def _expect_crlf(self, limit: int = _HEADER_READ_BYTES) -> None:
        """Consume the CRLF after a value; a read for it asks for at most `limit` bytes."""
        while self._end - self._start < 2:
            self._fill(limit)
        if self._view[self._start : self._start + 2] != _CRLF:
            raise redis.exceptions.InvalidResponse("bulk reply not terminated by CRLF")
        self._start += 2


def _first_bytes(ranges: Ranges, length: int) -> list[memoryview]:
    """The ranges that the first `length` bytes of their concatenation fill (the last cut)."""
    covered: list[memoryview] = []
    for view in ranges:
        if length <= 0:
            break
        covered.append(view[:length])
        length -= view.nbytes
    return covered


def _length(piece: bytes | memoryview) -> int:
    return len(piece) if isinstance(piece, bytes) else piece.nbytes


def _integer(text: bytes) -> int:
    """A RESP integer or length; anything else is an invalid reply, not a `ValueError`."""
    digits = text[1:] if text[:1] == b"-" else text
    if not digits.isdigit() or len(digits) > _MAX_INTEGER_DIGITS:
        raise redis.exceptions.InvalidResponse(
            f"expected an integer in the reply, got {text[: _MAX_INTEGER_DIGITS + 1]!r}"
        )
    return int(text)
