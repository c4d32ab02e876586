"""A `kvwire.media.BlockStore` on a Redis or Valkey server.

One key per block: `key_prefix` + the store key the connector hands over
(layout fingerprint / block hash); the value is the whole encoded entry
(header plus payload, see `kvwire.blocks.format`). Redis
`SET` is atomic, so a reader sees a whole entry or none.

Every call is pipelined in batches. Values go out zero-copy and replies are
read straight into the caller's buffers (see
`kvwire.media.store.redis._wire`). The connector's data path
(`RedisBlockStore.read_into_ranges`, `RedisBlockStore.write_ranges`)
gives each entry as its byte ranges in the KV cache: a `SET` sends them as
they are (`sendmsg`), a `GET` reply is scattered over them
(`recvmsg_into`), so a block moves between the cache and the server with
no staging copy.

Every call has an overall deadline (`load_timeout_s`, `save_timeout_s`,
`lookup_timeout_s`): the socket timeout bounds each read, not a reply, so a
server that sends a byte every few seconds would otherwise hold a load, and
the engine waiting for it, forever. Past its deadline a call fails as in an
outage, and its connection, left mid-reply, is dropped, never reused.

A value longer than the entry it should hold is refused from its length
before its bytes are read: it is drained, never held in memory, warned
about and deleted like any other corrupt entry.

An unreachable, dying or hung server is an *outage*, not an error: lookups
count as misses, saves are dropped and counted, loads return None (the
connector reports them as load errors). A lookup runs on the scheduler's
thread, so the scheduler waits for it at most `lookup_timeout_s`, on the
first call to a hung server too: the lookup runs on a thread of its own and
is given up on at its deadline (see `kvwire.media.outage`). While the
outage lasts, calls answer at once and a background probe waits for the
server to come back; the connection pool then reconnects by itself. The
password never appears in a log line, an error or a repr.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvwire.common.redaction import shown
from kvwire.media.outage import OutageTracker, ServerUnavailable
from kvwire.media.store.base import CacheWrites
from kvwire.media.store.redis._common import FailureCounts, RedisStoreBase, require_one_each
from kvwire.media.store.redis._wire import (
    Deadline,
    DeadlineExceeded,
    Ranges,
    Reply,
    RespStream,
    ZeroCopyCommandPacker,
)
from kvwire.media.store.redis.settings import RedisStoreSettings

logger = logging.getLogger(__name__)

# Per-thread buffer for reply headers and the bytes that arrive with them.
_SCRATCH_BYTES = 256 * 1024

#: A load sends its GETs in groups of about this many reply bytes, the next
#: group as soon as the current one is answered (see read_each); 4 MiB loaded
#: fastest of 1-8 MiB (`--only redis`; the figures are in docs/performance.md).
READ_GROUP_BYTES = 4 * 1024 * 1024

# Errors that fail a whole call: the server cannot be reached right now
# (refused, reset, timed out, still loading, authentication refused), or the
# conversation with it broke (a reply that makes no sense). Either way the
# call's keys are misses or failures, and the engine never sees an exception.
_OUTAGE_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)


class RedisBlockStore(RedisStoreBase):
    """Encoded KV blocks in a Redis/Valkey server, one key per block.

    Safe to share between threads (a blocking connection pool of
    `settings.pool_size` connections) and between processes and hosts (the
    server is the only shared state). `counters()` reports what was
    dropped or failed during outages; `settings` is read-only.
    """

    def __init__(self, settings: RedisStoreSettings) -> None:
        super().__init__(settings)
        self._packer = ZeroCopyCommandPacker()
        self._pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            **settings.connection_pool_kwargs(),
            command_packer=self._packer,
            # A failed connect is an outage at once (the probe tries again);
            # the store retries a stale pooled connection itself (_execute).
            retry=Retry(NoBackoff(), 0),
            redis_connect_func=self._handshake,
        )
        self._outage = OutageTracker(
            f"Redis at {settings.display_url}",
            while_down="lookups miss, saves are dropped and loads fail",
            probe=self._ping,
            errors=_OUTAGE_ERRORS,
            describe=lambda error: _scrub(error, settings),
            retry_interval_s=settings.retry_interval_s,
            warning_interval_s=settings.warning_interval_s,
            logger=logger,
            thread_name="kvwire-redis",
        )
        self._failures = FailureCounts(
            (
                "lookup_failures",
                "saves_dropped",
                "saves_rejected",
                "load_failures",
                "loads_oversized",
                "loads_refused",
            )
        )
        self._thread_local = threading.local()
        # Two groups in flight stay within pipeline_bytes.
        self._read_group_bytes = max(1, min(READ_GROUP_BYTES, settings.pipeline_bytes // 2))
        self._removed_lock = threading.Lock()
        self._removed_keys: list[str] = []

    @property
    def is_available(self) -> bool:
        """False while the last attempt failed (the store is in an outage)."""
        return not self._outage.is_down

    def counters(self) -> dict[str, int]:
        """Cumulative failure counters: lookups, dropped/rejected saves, failed loads."""
        return self._failures.totals()

    def take_counters(self) -> dict[str, int]:
        """The non-zero counters since the last call (for stats, which report increments)."""
        return self._failures.take_increments()

    # ------------------------------------------------------------ BlockStore

    def count_prefix(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, the server holds; 0 in an outage.

        Waits at most `lookup_timeout_s` whatever the server does (see
        `begin_count_prefix`).
        """
        lookup = self.begin_count_prefix(keys)
        return self.end_count_prefix(lookup, time.monotonic() + self._settings.lookup_timeout_s)

    def begin_count_prefix(self, keys: Sequence[str]) -> concurrent.futures.Future[int] | None:
        """The first half of `count_prefix`: the lookup, started on a thread of its own.

        None when there is nothing to ask (no keys, or the server is down).
        Lookups run on the scheduler's thread: it waits for the answer only
        until a deadline (`end_count_prefix`), and a server that hangs
        costs the first lookup that deadline, not its socket timeouts. Two
        halves, so a cluster asks every master at once.
        """
        if not keys:
            return None
        try:
            return self._outage.begin("lookup", lambda: self._count_present(keys))
        except ServerUnavailable:
            return None

    def end_count_prefix(
        self, lookup: concurrent.futures.Future[int] | None, deadline: float
    ) -> int:
        """The answer to a lookup `begin_count_prefix` started, by `deadline`
        (`time.monotonic()`); 0 when it failed or is not answered by then (an outage)."""
        if lookup is None:
            return 0
        try:
            seconds = self._settings.lookup_timeout_s
            return self._outage.wait("lookup", lookup, deadline, f"lookup_timeout_s={seconds:g}s")
        except ServerUnavailable as unavailable:
            if unavailable.asked:
                self._count("lookup_failures", 1)
            return 0

    def _count_present(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, exist: `EXISTS` in pipelines; raises on an outage."""
        present = 0
        deadline = self._lookup_deadline()
        for batch in _batches(len(keys), self._settings.lookup_batch_size):
            commands = [("EXISTS", self.redis_key(keys[index])) for index in batch]
            for found in self._execute(commands, deadline):
                if found != 1:
                    return present
                present += 1
        return present

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        require_one_each("put", keys, entries, "entries")
        return self._set(keys, entries, [entry.nbytes for entry in entries])

    def write_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        commit_gate: CacheWrites | None = None,
    ) -> list[bool]:
        """As `put`, each value sent straight from its ranges: never joined or copied.

        A value's final CRLF goes out only while `commit_gate` is open (see
        `kvwire.media.BlockStore.write_ranges`); once it is closed the
        connection is dropped before it, so the server never runs that `SET`, nor any after it.
        """
        require_one_each("write_ranges", keys, ranges_per_key, "entries")
        values = [_ranges(ranges) for ranges in ranges_per_key]
        return self._set(
            keys, values, [sum(view.nbytes for view in ranges) for ranges in values], commit_gate
        )

    def _set(
        self,
        keys: Sequence[str],
        values: Sequence[memoryview | Ranges],
        sizes: Sequence[int],
        commit_gate: CacheWrites | None = None,
    ) -> list[bool]:
        """`SET` each value (a memoryview, or ranges sent in order) in pipelines of at most
        `pipeline_bytes`; True where the server stored it (each value's end sent through
        `commit_gate`)."""
        stored = [False] * len(keys)
        if not keys:
            return stored
        if self._outage.is_down:
            self._count("saves_dropped", len(keys))
            return stored
        expiry = () if self._settings.ttl_seconds is None else ("EX", self._settings.ttl_seconds)
        deadline = self._deadline(self._settings.save_timeout_s, "save_timeout_s")
        for batch in _batches_by_bytes(sizes, self._settings.pipeline_bytes):
            if commit_gate is not None and commit_gate.closed:
                break
            commands = [("SET", self.redis_key(keys[i]), values[i], *expiry) for i in batch]
            try:
                replies = self._execute(commands, deadline, commit_gate)
            except _OUTAGE_ERRORS as error:
                unsaved = len(keys) - batch.start
                self._on_outage("save", error, "saves_dropped", unsaved)
                return stored
            rejected: BaseException | None = None
            # Fewer replies than commands: the gate closed, the rest never ran.
            for index, reply in zip(batch, replies, strict=False):
                if isinstance(reply, redis.exceptions.ResponseError) and not self._redirected(
                    reply
                ):
                    # e.g. OOM under maxmemory with noeviction: this value, not the server.
                    rejected = reply
                    self._count("saves_rejected", 1)
                else:
                    stored[index] = reply == b"OK"
            if rejected is not None:
                self._outage.warn(
                    f"Redis at {self._settings.display_url} rejected a save "
                    f"({_scrub(rejected, self._settings)}); the block is not stored"
                )
        self._outage.succeeded()
        return stored

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sizes_read: list[int | None] = [None] * len(keys)
        for index, size in self.read_each(keys, buffers):
            sizes_read[index] = size
        return sizes_read

    def read_each(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> Generator[tuple[int, int | None], None, None]:
        """Pipelined GETs on one connection; each reply is yielded as soon as it is in its buffer.

        See `_read`.
        """
        require_one_each("read_each", keys, buffers, "buffers")
        yield from self._read(
            keys,
            [buffer.nbytes for buffer in buffers],
            lambda stream, index: stream.read_into(buffers[index]),
        )

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        """As `read_each`, each reply scattered from the socket over its key's ranges.

        Every write into the ranges goes through `writes` (see
        `kvwire.media.BlockStore.read_into_ranges`): once the load is
        given up on, the `JobAbandoned` it raises ends the call and its connection is dropped, so
        nothing more lands in the cache; a read already in flight returns within the socket timeout.
        """
        require_one_each("read_into_ranges", keys, ranges_per_key, "entries")
        all_ranges = [_ranges(ranges) for ranges in ranges_per_key]
        yield from self._read(
            keys,
            [sum(view.nbytes for view in ranges) for ranges in all_ranges],
            lambda stream, index: stream.read_into_ranges(all_ranges[index], writes),
        )

    def _read(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        read_reply: Callable[[RespStream, int], int | redis.exceptions.ResponseError | None],
    ) -> Generator[tuple[int, int | None], None, None]:
        """Pipelined GETs of `keys` on one connection, yielding `(index, size or None)`.

        `read_reply(stream, index)` reads key `index`'s reply where it
        belongs; `sizes` are the room each has. The GETs go out in groups,
        and the next group goes out as soon as the first reply of the current
        one is read (the server answers a group only once it has run all of
        its GETs): while the caller checks one entry, the server runs the
        next group's GETs and sends their replies, so the two overlap.
        """
        if not keys:
            return
        if self._outage.is_down:
            self._count("load_failures", len(keys))
            yield from ((index, None) for index in range(len(keys)))
            return
        next_index = 0
        deadline = self._deadline(self._settings.load_timeout_s, "load_timeout_s")
        too_long: list[str] = []
        try:
            replies = self._get_stream(
                [self.redis_key(key) for key in keys], sizes, read_reply, deadline
            )
            with contextlib.closing(replies):
                for index, reply in enumerate(replies):
                    next_index = index + 1
                    if reply == RespStream.OVERSIZED:
                        too_long.append(keys[index])
                    yield index, self._size_of(reply)
        except _OUTAGE_ERRORS as error:
            self._on_outage("load", error, "load_failures", len(keys) - next_index)
            yield from ((index, None) for index in range(next_index, len(keys)))
            return
        finally:
            if too_long:
                self._discard_too_long(too_long)
        self._outage.succeeded()

    def _discard_too_long(self, keys: list[str]) -> None:
        """Warn about values longer than their entries, and delete them as corrupt entries are."""
        self._outage.warn(
            f"Redis at {self._settings.display_url} held {len(keys)} value(s) longer than "
            f"the entry they should hold; not loaded, and deleted"
        )
        self.discard(keys)

    def _size_of(self, reply: int | redis.exceptions.ResponseError | None) -> int | None:
        """The bytes a GET reply put in its buffer; None for a miss or a refusal (counted)."""
        if isinstance(reply, redis.exceptions.ResponseError):
            if self._redirected(reply):
                return None
            # e.g. WRONGTYPE, or NOPERM from an ACL: a failure the operator must see.
            self._count("loads_refused", 1)
            self._outage.warn(
                f"Redis at {self._settings.display_url} refused a load "
                f"({_scrub(reply, self._settings)}); the block is treated as missing"
            )
            return None
        if reply == RespStream.OVERSIZED:
            self._count("loads_oversized", 1)
            return None
        return reply  # None is a miss: the caller reports it

    def _redirected(self, reply: redis.exceptions.ResponseError) -> bool:
        """Whether an error reply only says the key lives on another server (a cluster's MOVED).

        A single server never says so; a cluster node's store (see
        `kvwire.media.store.redis.cluster`) does: there the reply
        is a stale slot map, not a refusal to warn about. The key then counts
        as not stored, or missing.
        """
        return False

    def _get_stream(
        self,
        names: list[str],
        sizes: Sequence[int],
        read_reply: Callable[[RespStream, int], int | redis.exceptions.ResponseError | None],
        deadline: Deadline,
    ) -> Generator[int | redis.exceptions.ResponseError | None, None, None]:
        """GETs of `names` on one connection, each reply read from the socket by `read_reply`.

        Yields the replies one by one. At most two groups of GETs are
        unanswered at a time, so the replies waiting in the server stay under
        `pipeline_bytes`. The connection is held until the last reply is
        read; one left unread (the caller stopped early, an error, the
        deadline, a load given up on) means the stream is out of step, so the
        connection is dropped.
        """
        groups = list(_batches_by_bytes(sizes, self._read_group_bytes))
        ttl = self._settings.ttl_seconds

        def commands(group: range) -> list[tuple[Any, ...]]:
            # With a TTL, a load restarts it (GETEX): blocks in use stay, idle ones expire.
            return [
                ("GET", names[i]) if ttl is None else ("GETEX", names[i], "EX", ttl) for i in group
            ]

        with self._connection() as connection:
            # GET is idempotent: one retry on a fresh connection covers a
            # pooled connection that went stale when the server restarted. A
            # stale connection fails at the latest on the first reply, before
            # anything was yielded.
            for attempt in (1, 2):
                try:
                    stream = self._stream(connection, deadline)
                    stream.send(connection.pack_commands(commands(groups[0])))
                    first = read_reply(stream, 0)
                    break
                except DeadlineExceeded:
                    raise
                except _OUTAGE_ERRORS:
                    connection.disconnect()
                    if attempt == 2:
                        raise
            for number, group in enumerate(groups):
                for index in group:
                    reply = first if index == 0 else read_reply(stream, index)
                    if index == group.start and number + 1 < len(groups):
                        stream.send(connection.pack_commands(commands(groups[number + 1])))
                    yield reply

    def _execute(
        self,
        commands: Sequence[tuple[Any, ...]],
        deadline: Deadline,
        commit_gate: CacheWrites | None = None,
    ) -> list[Reply]:
        """Send `commands` in one pipeline and read their short replies (errors as values).

        Every command sent here is idempotent, so a failure before the first
        reply (a pooled connection gone stale when the server restarted) is
        retried once on a fresh connection, within the same deadline. With
        `commit_gate`, each command ends only while it is open
        (`RespStream.send_gated`): the replies are then those of the
        commands sent whole, and a connection left mid-command is dropped.
        """
        replies: list[Reply] = []

        def exchange(connection: Any) -> None:
            stream = self._stream(connection, deadline)
            if commit_gate is None:
                stream.send(connection.pack_commands(commands))
                sent = len(commands)
            else:
                packed = [self._packer.pack(*command) for command in commands]
                sent = stream.send_gated(packed, commit_gate)
            for _ in range(sent):
                replies.append(stream.read_reply())
            if sent < len(commands):
                connection.disconnect()

        with self._connection() as connection:
            try:
                exchange(connection)
            except DeadlineExceeded:
                raise
            except _OUTAGE_ERRORS:
                if replies:
                    raise
                connection.disconnect()
                exchange(connection)
        return replies

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        """A pooled connection for one call; dropped unless the call read every reply it asked for.

        A connection left mid-reply (an error, the deadline, a caller that
        stopped early) would hand the rest of that reply to the next call.
        """
        connection = self._pool.get_connection()  # type: ignore[no-untyped-call]
        in_step = False
        try:
            yield connection
            in_step = True
        finally:
            if not in_step:
                connection.disconnect()
            self._pool.release(connection)  # type: ignore[no-untyped-call]

    def _stream(self, connection: Any, deadline: Deadline) -> RespStream:
        """The connection's socket (connected again if a retry dropped it) as a RespStream.

        `connection` is a redis-py connection (untyped there).
        """
        deadline.check()
        connection.connect()
        # redis-py keeps the socket private; reading it directly is what
        # saves the copies (see redis_wire).
        return RespStream(connection._sock, self._scratch(), deadline)

    def _handshake(self, connection: Any) -> None:
        """redis-py's handshake on a new connection (AUTH, SELECT...), cut off at connect_timeout_s.

        Its reads are bounded one by one by the socket timeout only, so a
        server dribbling its answers would hold every new connection. A timer
        shuts the socket down at the deadline, which ends the read in progress
        with an error; connecting is rare, so a thread for it costs nothing.
        """
        sock = connection._sock
        cut_off = threading.Event()

        def cut() -> None:
            cut_off.set()
            # socket.shutdown, not a TLS socket's own: that one tears down the
            # TLS state under the thread still reading it.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

        timer = threading.Timer(self._settings.connect_timeout_s, cut)
        timer.daemon = True
        timer.start()
        try:
            connection.on_connect()
        finally:
            timer.cancel()
            # cut() only shuts a socket down, which never blocks; the bound
            # keeps this wait, like every other, from being open-ended.
            timer.join(timeout=self._settings.connect_timeout_s)
            if cut_off.is_set():
                # In place of the read error the cut caused: this one says why.
                seconds = self._settings.connect_timeout_s
                raise DeadlineExceeded(
                    f"no complete handshake within connect_timeout_s={seconds:g}s"
                )

    def _deadline(self, seconds: float, setting: str) -> Deadline:
        return Deadline(seconds, setting, socket_timeout_s=self._settings.socket_timeout_s)

    def _lookup_deadline(self) -> Deadline:
        return self._deadline(self._settings.lookup_timeout_s, "lookup_timeout_s")

    def _ping(self) -> None:
        """The reconnect probe: raises unless the server answers `PING`."""
        reply = self._execute([("PING",)], self._lookup_deadline())[0]
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply

    def _scratch(self) -> bytearray:
        scratch: bytearray | None = getattr(self._thread_local, "scratch", None)
        if scratch is None:
            scratch = self._thread_local.scratch = bytearray(_SCRATCH_BYTES)
        return scratch

    def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys`; how many existed. An outage counts as 0 removed."""
        if not keys or self._outage.is_down:
            return 0
        try:
            removed = self._unlink([self.redis_key(key) for key in keys], self._lookup_deadline())
        except _OUTAGE_ERRORS as error:
            self._on_outage("delete", error, "lookup_failures", 0)
            return 0
        self._outage.succeeded()
        return removed

    def discard(self, keys: Sequence[str]) -> None:
        """Delete entries a reader found corrupt, so they stop being hits for every engine.

        One `UNLINK` per key in a pipeline, so each answer says whether that
        key still existed: only those are reported by `take_removed_keys`.
        During an outage nothing is deleted; the next reader finds them again.
        """
        if not keys or self._outage.is_down:
            return
        try:
            commands = [("UNLINK", self.redis_key(key)) for key in keys]
            existed = [
                _count_of(reply) for reply in self._execute(commands, self._lookup_deadline())
            ]
        except _OUTAGE_ERRORS as error:
            self._on_outage("discard", error, "lookup_failures", 0)
            return
        self._outage.succeeded()
        removed = [key for key, count in zip(keys, existed, strict=True) if count]
        with self._removed_lock:
            self._removed_keys.extend(removed)

    def take_removed_keys(self) -> list[str]:
        with self._removed_lock:
            removed, self._removed_keys = self._removed_keys, []
        return removed

    def clear(self, under: str = "") -> int:
        """Remove every key under this store's prefix (+ `under`); how many. Outages give 0."""
        if self._outage.is_down:
            return 0
        removed = 0
        pattern = _glob_escape(self._settings.key_prefix + under) + "*"
        try:
            # Each round trip has a deadline of its own: a large key space
            # takes as many as it needs, a stalled server fails one of them.
            cursor = b"0"
            while True:
                scan = ("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
                cursor, names = _scan_page(self._execute([scan], self._lookup_deadline())[0])
                if names:
                    removed += self._unlink(names, self._lookup_deadline())
                if cursor == b"0":
                    break
        except _OUTAGE_ERRORS as error:
            self._on_outage("clear", error, "lookup_failures", 0)
            return removed
        self._outage.succeeded()
        return removed

    def close(self) -> None:
        self._outage.close()
        self._pool.disconnect()

    def _unlink(self, names: Sequence[str | bytes], deadline: Deadline) -> int:
        """Delete `names` in one command; how many existed."""
        return _count_of(self._execute([("UNLINK", *names)], deadline)[0])

    # -------------------------------------------------------------- helpers

    def _on_outage(self, what: str, error: BaseException, counter: str, amount: int) -> None:
        self._count(counter, amount)
        self._outage.failed(what, _scrub(error, self._settings))

    def _count(self, counter: str, amount: int) -> None:
        self._failures.add(counter, amount)


def _ranges(ranges: Sequence[memoryview]) -> Ranges:
    """An entry's ranges as the wire takes them (a list or tuple), without copying a list given."""
    return ranges if isinstance(ranges, (list, tuple)) else list(ranges)


def _batches(count: int, batch_size: int) -> Iterator[range]:
    for start in range(0, count, batch_size):
        yield range(start, min(start + batch_size, count))


def _batches_by_bytes(sizes: Sequence[int], max_bytes: int) -> Iterator[range]:
    """Consecutive ranges of at most `max_bytes` (a larger single item is a range alone).

    Bounds what one pipeline holds in flight: the server queues every reply
    of a pipeline in its memory while the client works through them.
    """
    start = 0
    while start < len(sizes):
        end = start + 1
        total = sizes[start]
        while end < len(sizes) and total + sizes[end] <= max_bytes:
            total += sizes[end]
            end += 1
        yield range(start, end)
        start = end


def _count_of(reply: Reply) -> int:
    """An integer reply (a count), or the error the server answered instead, raised."""
    if isinstance(reply, redis.exceptions.ResponseError):
        raise reply
    if not isinstance(reply, int):
        raise redis.exceptions.InvalidResponse(f"expected a count, got a {type(reply).__name__}")
    return reply


def _scan_page(reply: Reply) -> tuple[bytes, list[bytes]]:
    """SCAN's reply as (next cursor, names), or the error the server answered instead, raised."""
    if isinstance(reply, redis.exceptions.ResponseError):
        raise reply
    if isinstance(reply, list) and len(reply) == 2:
        cursor, names = reply
        if (
            isinstance(cursor, bytes)
            and isinstance(names, list)
            and all(isinstance(name, bytes) for name in names)
        ):
            return cursor, [name for name in names if isinstance(name, bytes)]
    raise redis.exceptions.InvalidResponse("SCAN's reply is not [cursor, [names]]")


def _glob_escape(text: str) -> str:
    return "".join(f"\\{char}" if char in "*?[]\\" else char for char in text)


def _scrub(error: BaseException, settings: RedisStoreSettings) -> str:
    """The error's text, with the password blanked should a server or library echo it.

    Bounded: a server's error reply may be as long as a reply header can be
    (the scratch buffer's 256 KiB), and a log line shows its start.
    """
    return shown(settings.redact(f"{type(error).__name__}: {error}"))
