"""A misbehaving Redis server for the deadline tests: it answers chosen commands a byte at a time.

It speaks just enough RESP for the store (the handshake, ``PING``,
``EXISTS``, ``SET``, ``GET``/``GETEX``, ``UNLINK``) over loopback TCP and
keeps values in memory. A reply to a command named in ``slow`` goes out one
byte every ``byte_interval_s``: each read on the client side succeeds well
within its socket timeout, yet the whole reply takes minutes. That is the
server a socket timeout alone cannot bound.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO


class DribblingServer:
    """A loopback RESP server whose replies to the commands in ``slow`` trickle out."""

    def __init__(self, byte_interval_s: float = 0.2) -> None:
        self.byte_interval_s = byte_interval_s
        #: Upper-case command names whose replies are sent a byte at a time.
        self.slow: set[bytes] = set()
        self.values: dict[bytes, bytes] = {}
        #: Replies the client stopped reading halfway (it closed the connection).
        self.replies_cut_off = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        # accept() wakes up this often to see whether the server is closing.
        self._listener.settimeout(0.05)
        self._connections: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._start(self._accept_all)

    @property
    def url(self) -> str:
        host, port = self._listener.getsockname()
        return f"redis://{host}:{port}/0"

    def close(self) -> None:
        """Stop answering, close every connection and wait for the server's threads."""
        self._stopped.set()
        with self._lock:
            for connection in self._connections:
                # shutdown, not close: it wakes a thread blocked reading it.
                # (OSError: the client closed it already.)
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)
            assert not thread.is_alive(), "the dribbling server did not stop"
        self._listener.close()

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_all(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            with self._lock:
                self._connections.append(connection)
            self._start(self._serve, connection)

    def _serve(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as incoming:
            try:
                for command in _commands(incoming):
                    reply = self._answer(command)
                    if command[0].upper() in self.slow:
                        self._dribble(connection, reply)
                    else:
                        connection.sendall(reply)
            except OSError:
                return  # the client went away, or the server is closing

    def _dribble(self, connection: socket.socket, reply: bytes) -> None:
        for offset in range(len(reply)):
            if self._stopped.wait(self.byte_interval_s):
                return
            try:
                connection.sendall(reply[offset : offset + 1])
            except OSError:
                with self._lock:
                    self.replies_cut_off += 1
                raise

    def _answer(self, command: list[bytes]) -> bytes:
        name, args = command[0].upper(), command[1:]
        if name == b"PING":
            return b"+PONG\r\n"
        if name in (b"CLIENT", b"SELECT"):
            return b"+OK\r\n"
        if name == b"EXISTS":
            return b":%d\r\n" % sum(key in self.values for key in args)
        if name == b"SET":
            self.values[args[0]] = args[1]
            return b"+OK\r\n"
        if name in (b"GET", b"GETEX"):
            value = self.values.get(args[0])
            return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)
        if name == b"UNLINK":
            return b":%d\r\n" % sum(self.values.pop(key, None) is not None for key in args)
        return b"-ERR unknown command '%s'\r\n" % name


def _commands(incoming: BinaryIO) -> Iterator[list[bytes]]:
    """The commands a client sends: RESP arrays of bulk strings, until it closes."""
    while True:
        header = incoming.readline()
        if not header:
            return
        command = []
        for _ in range(int(header[1:])):
            length = int(incoming.readline()[1:])
            command.append(incoming.read(length + 2)[:length])
        yield command
