"""A :class:`~kvwire.connectors.store.BlockStore` on a Redis or Valkey server.

One key per block: ``key_prefix`` + the store key the connector hands over
(layout fingerprint / block hash); the value is the whole encoded entry
(header plus payload, see :mod:`kvwire.connectors.block_format`). Redis
``SET`` is atomic, so a reader sees a whole entry or none.

Every call is pipelined in batches. Values go out zero-copy and replies are
read straight into the caller's buffers (see
:mod:`kvwire.connectors.redis_wire`).

An unreachable or dying server is an *outage*, not an error: lookups count as
misses, saves are dropped and counted, loads return None (the connector
reports them as load errors). While it lasts, calls answer at once and a
background probe waits for the server to come back (see
:mod:`kvwire.connectors.redis_outage`); the connection pool then reconnects
by itself. The password never appears in a log line, an error or a repr.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Generator, Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvwire.connectors.redis_outage import OutageTracker
from kvwire.connectors.redis_settings import RedisStoreSettings
from kvwire.connectors.redis_wire import BulkReplyReader, ZeroCopyCommandPacker
from kvwire.connectors.store import BlockStore

logger = logging.getLogger(__name__)

# Per-thread buffer for reply headers and the bytes that arrive with them.
_SCRATCH_BYTES = 256 * 1024

#: A load sends its GETs in groups of about this many reply bytes, the next
#: group as soon as the current one is answered (see read_each). Measured with
#: benchmarks/redis.py (one thread, 2 cores, 256 KiB and 1 MiB blocks): groups
#: of 1, 2, 4 and 8 MiB loaded at 1.14/0.86, 1.11/1.07, 1.25/1.51 and
#: 1.04/1.07 of plain GET pipelines of 8 blocks; without read-ahead, 0.72-0.77.
READ_GROUP_BYTES = 4 * 1024 * 1024

# Errors that fail a whole call: the server cannot be reached right now
# (refused, reset, timed out, still loading, authentication refused), or the
# conversation with it broke (a reply that makes no sense). Either way the
# call's keys are misses or failures, and the engine never sees an exception.
_OUTAGE_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)


class RedisBlockStore(BlockStore):
    """Encoded KV blocks in a Redis/Valkey server, one key per block.

    Safe to share between threads (a blocking connection pool of
    ``settings.pool_size`` connections) and between processes and hosts (the
    server is the only shared state). ``counters()`` reports what was
    dropped or failed during outages; ``settings`` is read-only.
    """

    medium = "redis"

    def __init__(self, settings: RedisStoreSettings) -> None:
        self._settings = settings
        self._pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            **settings.connection_pool_kwargs(),
            command_packer=ZeroCopyCommandPacker(),
            # One immediate retry on a fresh connection: after a server restart
            # every pooled connection is stale, and the first use of each fails.
            retry=Retry(NoBackoff(), 1),
        )
        self._client = redis.Redis(connection_pool=self._pool)
        self._outage = OutageTracker(
            settings.display_url,
            probe=self._client.ping,
            probe_errors=_OUTAGE_ERRORS,
            retry_interval_s=settings.retry_interval_s,
            warning_interval_s=settings.warning_interval_s,
        )
        self._counter_lock = threading.Lock()
        self._counters: dict[str, int] = {
            "lookup_failures": 0,
            "saves_dropped": 0,
            "saves_rejected": 0,
            "load_failures": 0,
            "loads_oversized": 0,
            "loads_refused": 0,
        }
        self._taken: dict[str, int] = {}
        self._thread_local = threading.local()
        # Two groups in flight stay within pipeline_bytes.
        self._read_group_bytes = max(1, min(READ_GROUP_BYTES, settings.pipeline_bytes // 2))
        self._removed_lock = threading.Lock()
        self._removed_keys: list[str] = []

    def __repr__(self) -> str:
        return (
            f"RedisBlockStore(url={self._settings.display_url!r}, "
            f"key_prefix={self._settings.key_prefix!r})"
        )

    @property
    def settings(self) -> RedisStoreSettings:
        return self._settings

    @property
    def is_available(self) -> bool:
        """False while the last attempt failed (the store is in an outage)."""
        return not self._outage.is_down

    def counters(self) -> dict[str, int]:
        """Cumulative failure counters: lookups, dropped/rejected saves, failed loads."""
        with self._counter_lock:
            return dict(self._counters)

    def take_counters(self) -> dict[str, int]:
        """The non-zero counters since the last call (for stats, which report increments)."""
        with self._counter_lock:
            current = dict(self._counters)
            increments = {
                f"redis_{name}": value - self._taken.get(name, 0)
                for name, value in current.items()
                if value != self._taken.get(name, 0)
            }
            self._taken = current
        return increments

    def redis_key(self, key: str) -> str:
        """The server-side name of a store key."""
        return self._settings.key_prefix + key

    # ------------------------------------------------------------ BlockStore

    def count_prefix(self, keys: Sequence[str]) -> int:
        if not keys or self._outage.is_down:
            return 0
        present = 0
        try:
            for batch in _batches(len(keys), self._settings.lookup_batch_size):
                pipeline = self._client.pipeline(transaction=False)
                for index in batch:
                    pipeline.exists(self.redis_key(keys[index]))
                for found in pipeline.execute(raise_on_error=False):
                    if found != 1:
                        self._outage.succeeded()
                        return present
                    present += 1
        except _OUTAGE_ERRORS as error:
            self._on_outage("lookup", error, "lookup_failures", 1)
            return 0
        self._outage.succeeded()
        return present

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        if len(keys) != len(entries):
            raise ValueError(f"put: {len(keys)} keys but {len(entries)} entries")
        stored = [False] * len(keys)
        if not keys:
            return stored
        if self._outage.is_down:
            self._count("saves_dropped", len(keys))
            return stored
        ttl = self._settings.ttl_seconds
        sizes = [entry.nbytes for entry in entries]
        for batch in _batches_by_bytes(sizes, self._settings.pipeline_bytes):
            pipeline = self._client.pipeline(transaction=False)
            for index in batch:
                pipeline.set(self.redis_key(keys[index]), entries[index], ex=ttl)
            try:
                replies = pipeline.execute(raise_on_error=False)
            except _OUTAGE_ERRORS as error:
                unsaved = len(keys) - batch.start
                self._on_outage("save", error, "saves_dropped", unsaved)
                return stored
            rejected: BaseException | None = None
            for index, reply in zip(batch, replies, strict=True):
                if isinstance(reply, Exception):
                    # e.g. OOM under maxmemory with noeviction: this value, not the server.
                    rejected = reply
                    self._count("saves_rejected", 1)
                else:
                    stored[index] = bool(reply)
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

        The GETs go out in groups, and the next group goes out as soon as
        the first reply of the current one is read (the server answers a
        group only once it has run all of its GETs): while the caller checks
        and copies one entry, the server runs the next group's GETs and sends
        their replies, so the two overlap.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"read_each: {len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return
        if self._outage.is_down:
            self._count("load_failures", len(keys))
            yield from ((index, None) for index in range(len(keys)))
            return
        next_index = 0
        try:
            replies = self._get_stream([self.redis_key(key) for key in keys], buffers)
            with contextlib.closing(replies):
                for index, reply in enumerate(replies):
                    next_index = index + 1
                    yield index, self._size_of(reply)
        except _OUTAGE_ERRORS as error:
            self._on_outage("load", error, "load_failures", len(keys) - next_index)
            yield from ((index, None) for index in range(next_index, len(keys)))
            return
        self._outage.succeeded()

    def _size_of(self, reply: int | redis.exceptions.ResponseError | None) -> int | None:
        """The bytes a GET reply put in its buffer; None for a miss or a refusal (counted)."""
        if isinstance(reply, redis.exceptions.ResponseError):
            # e.g. WRONGTYPE, or NOPERM from an ACL: a failure the operator must see.
            self._count("loads_refused", 1)
            self._outage.warn(
                f"Redis at {self._settings.display_url} refused a load "
                f"({_scrub(reply, self._settings)}); the block is treated as missing"
            )
            return None
        if reply == BulkReplyReader.OVERSIZED:
            self._count("loads_oversized", 1)
            return None
        return reply  # None is a miss: the caller reports it

    def _get_stream(
        self, names: list[str], buffers: Sequence[memoryview]
    ) -> Generator[int | redis.exceptions.ResponseError | None, None, None]:
        """GETs of ``names`` on one connection, each reply read from the socket into its buffer.

        Yields the replies one by one. At most two groups of GETs are
        unanswered at a time, so the replies waiting in the server stay under
        ``pipeline_bytes``. The connection is held until the last reply is
        read; one left unread (the caller stopped early, or an error) means
        the stream is out of step, so the connection is dropped.
        """
        sizes = [buffer.nbytes for buffer in buffers]
        groups = list(_batches_by_bytes(sizes, self._read_group_bytes))
        ttl = self._settings.ttl_seconds
        connection = self._pool.get_connection()  # type: ignore[no-untyped-call]

        def send(group: range) -> None:
            # With a TTL, a load restarts it (GETEX): blocks in use stay, idle ones expire.
            commands = [
                ("GET", names[i]) if ttl is None else ("GETEX", names[i], "EX", ttl) for i in group
            ]
            connection.send_packed_command(connection.pack_commands(commands))

        complete = False
        try:
            # GET is idempotent: one retry on a fresh connection covers a
            # pooled connection that went stale when the server restarted. A
            # stale connection fails at the latest on the first reply, before
            # anything was yielded.
            for attempt in (1, 2):
                try:
                    send(groups[0])
                    # redis-py keeps the socket private; reading it directly is
                    # what saves the copies (see redis_wire).
                    reader = BulkReplyReader(connection._sock, self._scratch())
                    first = reader.read_into(buffers[0])
                    break
                except _OUTAGE_ERRORS:
                    connection.disconnect()
                    if attempt == 2:
                        raise
            for number, group in enumerate(groups):
                for index in group:
                    reply = first if index == 0 else reader.read_into(buffers[index])
                    if index == group.start and number + 1 < len(groups):
                        send(groups[number + 1])
                    yield reply
            complete = True
        finally:
            if not complete:
                connection.disconnect()
            self._pool.release(connection)  # type: ignore[no-untyped-call]

    def _scratch(self) -> bytearray:
        scratch: bytearray | None = getattr(self._thread_local, "scratch", None)
        if scratch is None:
            scratch = self._thread_local.scratch = bytearray(_SCRATCH_BYTES)
        return scratch

    def delete(self, keys: Sequence[str]) -> int:
        """Remove ``keys``; how many existed. An outage counts as 0 removed."""
        if not keys or self._outage.is_down:
            return 0
        try:
            removed = int(self._client.unlink(*(self.redis_key(key) for key in keys)))
        except _OUTAGE_ERRORS as error:
            self._on_outage("delete", error, "lookup_failures", 0)
            return 0
        self._outage.succeeded()
        return removed

    def discard(self, keys: Sequence[str]) -> None:
        """Delete entries a reader found corrupt, so they stop being hits for every engine.

        One ``UNLINK`` per key in a pipeline, so each answer says whether that
        key still existed: only those are reported by :meth:`take_removed_keys`.
        During an outage nothing is deleted; the next reader finds them again.
        """
        if not keys or self._outage.is_down:
            return
        try:
            pipeline = self._client.pipeline(transaction=False)
            for key in keys:
                pipeline.unlink(self.redis_key(key))
            existed = pipeline.execute()
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
        """Remove every key under this store's prefix (+ ``under``); how many. Outages give 0."""
        if self._outage.is_down:
            return 0
        removed = 0
        pattern = _glob_escape(self._settings.key_prefix + under) + "*"
        try:
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) == 1000:
                    removed += int(self._client.unlink(*batch))
                    batch.clear()
            if batch:
                removed += int(self._client.unlink(*batch))
        except _OUTAGE_ERRORS as error:
            self._on_outage("clear", error, "lookup_failures", 0)
            return removed
        self._outage.succeeded()
        return removed

    def close(self) -> None:
        self._outage.close()
        self._pool.disconnect()

    # -------------------------------------------------------------- helpers

    def _on_outage(self, what: str, error: BaseException, counter: str, amount: int) -> None:
        self._count(counter, amount)
        self._outage.failed(what, _scrub(error, self._settings))

    def _count(self, counter: str, amount: int) -> None:
        with self._counter_lock:
            self._counters[counter] += amount


def _batches(count: int, batch_size: int) -> Iterator[range]:
    for start in range(0, count, batch_size):
        yield range(start, min(start + batch_size, count))


def _batches_by_bytes(sizes: Sequence[int], max_bytes: int) -> Iterator[range]:
    """Consecutive ranges of at most ``max_bytes`` (a larger single item is a range alone).

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


def _glob_escape(text: str) -> str:
    return "".join(f"\\{char}" if char in "*?[]\\" else char for char in text)


def _scrub(error: BaseException, settings: RedisStoreSettings) -> str:
    """The error's text, with the password blanked should a server or library echo it."""
    return settings.redact(f"{type(error).__name__}: {error}")
