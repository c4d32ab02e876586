"""RESP on the wire without extra copies: commands out of, and replies into, caller buffers.

redis-py (with hiredis) copies every large value twice on the way out (to
``bytes``, then into the packed command) and, on the way in, reassembles each
reply from 64 KiB reads into a fresh ``bytes`` object. For KV blocks of
megabytes that is most of the cost. Here:

- :class:`ZeroCopyCommandPacker` is given to redis-py's connections as their
  ``command_packer``: a memoryview argument (a staging slot) goes to
  ``sendall`` untouched;
- :class:`BulkReplyReader` reads the replies of a pipeline of ``GET``
  straight from the connection's socket into the caller's buffers: each byte
  is copied once, from the kernel into the buffer that keeps it.

Only RESP2 (the default protocol) replies are read here.
"""

from __future__ import annotations

import socket
from typing import Any

import redis

_CRLF = b"\r\n"

# How much a read for a reply header (or the CRLF after a value) asks for. A
# header is at most 24 bytes; what arrives beyond it is the start of the next
# value and must be copied out of the scratch buffer. A read as large as the
# scratch buffer copied up to a whole 256 KiB value twice whenever the server
# was ahead of the client.
_HEADER_READ_BYTES = 512


class ZeroCopyCommandPacker:
    """Encodes commands in RESP without copying large values.

    redis-py calls ``pack(*args)`` and ``sendall``s each returned piece in
    order; a memoryview of a staging buffer is passed through untouched.
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
            if isinstance(argument, memoryview):
                view = argument if argument.format == "B" else argument.cast("B")
                value, length = view, view.nbytes
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


class BulkReplyReader:
    """Reads RESP2 bulk-string replies (``GET``'s) from a socket into caller buffers.

    ``scratch`` holds reply headers and the bytes that arrive with them; it
    is reused across calls (one per thread). A reply that does not fit its
    buffer is read and discarded, so the stream stays in step.
    """

    #: :meth:`read_into`'s answer for a value longer than its buffer.
    OVERSIZED = -1

    def __init__(self, sock: socket.socket, scratch: bytearray) -> None:
        self._sock = sock
        self._scratch = scratch
        self._view = memoryview(scratch)
        self._start = 0
        self._end = 0

    def read_into(self, target: memoryview) -> int | redis.exceptions.ResponseError | None:
        """The next reply: its length (now in ``target``), None for nil, or the server's error."""
        line = self._read_line()
        kind = line[:1]
        if kind == b"$":
            length = int(line[1:])
            if length < 0:
                return None
            if length > target.nbytes:
                self._discard(length + 2)
                return self.OVERSIZED
            self._read_exact(target[:length])
            self._expect_crlf()
            return length
        if kind == b"-":
            return redis.exceptions.ResponseError(line[1:].decode(errors="replace"))
        raise redis.exceptions.InvalidResponse(f"unexpected reply type {kind!r} to GET")

    def _fill(self, limit: int = _HEADER_READ_BYTES) -> None:
        """Receive up to ``limit`` more bytes into the scratch buffer."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._scratch):
            # Move the unread tail to the front to make room.
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        received = self._sock.recv_into(self._view[self._end : self._end + limit])
        if received == 0:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        self._end += received

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
            received = self._sock.recv_into(target[position:])
            if received == 0:
                raise redis.exceptions.ConnectionError("Connection closed by server.")
            position += received

    def _discard(self, count: int) -> None:
        while count > 0:
            if self._start == self._end:
                # Discarded bytes: read them in as large pieces as fit.
                self._fill(len(self._scratch))
            skipped = min(count, self._end - self._start)
            self._start += skipped
            count -= skipped

    def _expect_crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start : self._start + 2] != _CRLF:
            raise redis.exceptions.InvalidResponse("bulk reply not terminated by CRLF")
        self._start += 2
