"""The peers' directory: which peer holds which block, and how to reach each peer, in Redis.

Two kinds of small keys, both with an expiry (`directory_ttl_s`):

- an *entry* per block a peer holds,
  `<key_prefix>peer/<layout fingerprint>/<block hash>` ->
  `<peer name> <slot> <generation>`: written by the holder's scheduler
  side once the block's store completed (and written again while its pool
  holds the block, before it expires), deleted when the holder evicts
  the block, and deleted by a reader whose read of it failed. The layout
  fingerprint (model, dtype, shape, cache layout, KV cache group) is in
  the name (of a split engine, the whole split's: every rank's share), so
  engines of another model, layout or split never find each other's
  blocks;
- a *peer record* per live worker, `<key_prefix>peer-agent/<agent name>`
  (the peer's name; each rank's, `<peer name> rank<r>`, in a split engine):
  its NIXL agent's metadata and where its pool lies, refreshed by the
  worker while it runs. A peer that died stops refreshing it: its record
  expires, and readers then treat its entries as gone (and delete them).

Deletes are compare-and-delete (a server-side script): an entry is
deleted only while it still names the same peer, slot and generation, so a
reader's late delete never removes a newer announcement of the block.

The directory is a cache's index, not a source of truth: a read always
verifies the bytes it pulled. Its calls are made from the scheduler's
thread (lookups, announcements, withdrawals) and the worker's (a load's
lookups and peer records, the heartbeat), so none may wait on a hung server:
each runs on a thread of the directory's and is waited for at most
`lookup_timeout_s`. A call that fails or is not answered by then starts an
*outage* (`kvwire.media.outage`): until a background probe (every
`retry_interval_s`) is answered, every call answers at once without asking
(lookups miss, writes report that they were not made). Each call not made is
counted as `peer_directory_failures`.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvwire.blocks.transfers import TransferPayload
from kvwire.common.redaction import shown
from kvwire.interface.types import BlockHash
from kvwire.media.outage import OutageTracker, ServerUnavailable
from kvwire.media.store.redis.settings import RedisStoreSettings

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Deletes KEYS[1] only while it still holds ARGV[1].
_COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""

# Where a peer's pool lies: its base address, the size of one entry, its slot count.
_RECORD = struct.Struct("<QQQ")
# A peer name in an entry's value ends at the first space: none may hold one.
_NAME_LIMIT = 200
# What a call that could not reach the directory raises. redis-py's cluster
# errors (no slot map, a slot no master serves) are not RedisErrors.
_FAILURES: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    OSError,
)


@attrs.frozen
class Location:
    """Where one block lives: a peer's pool slot, and which use of that slot it is."""

    peer: str
    slot: int
    generation: int

    def encode(self) -> bytes:
        return f"{self.peer} {self.slot} {self.generation}".encode()

    @classmethod
    def decode(cls, value: bytes) -> Location | None:
        """The location `value` names, or None for a value no peer writes."""
        try:
            peer, slot, generation = value.decode("ascii").split(" ")
            return cls(peer, int(slot), int(generation))
        except (UnicodeDecodeError, ValueError):
            return None


@attrs.frozen
class FoundLocations(TransferPayload):
    """A load's payload: where the scheduler half's lookup found each block (None: not found).

    The worker reads each block there, and asks the directory only about the
    blocks found nowhere; it verifies what it reads all the same (a slot may
    have been reused since).
    """

    locations: tuple[Location | None, ...]

    def part(self, start: int, stop: int) -> FoundLocations:
        return FoundLocations(self.locations[start:stop])


@attrs.frozen
class PeerRecord:
    """A live peer: its NIXL agent's metadata and its pool's place in its memory."""

    agent_metadata: bytes = attrs.field(repr=lambda value: f"<{len(value)} bytes>")
    base_address: int
    entry_bytes: int
    num_slots: int

    def encode(self) -> bytes:
        return _RECORD.pack(self.base_address, self.entry_bytes, self.num_slots) + bytes(
            self.agent_metadata
        )

    @classmethod
    def decode(cls, value: bytes) -> PeerRecord | None:
        if len(value) <= _RECORD.size:
            return None
        base, entry_bytes, num_slots = _RECORD.unpack_from(value)
        return cls(bytes(value[_RECORD.size :]), base, entry_bytes, num_slots)

    def slot_address(self, slot: int) -> int | None:
        """The address of `slot`'s entry in the peer's memory; None if it has no such slot."""
        if not 0 <= slot < self.num_slots:
            return None
        return self.base_address + slot * self.entry_bytes


def check_peer_name(name: str) -> str | None:
    """None when `name` can name a peer, else what is accepted."""
    if not name or len(name) > _NAME_LIMIT or not name.isascii() or not name.isprintable():
        return f"printable ASCII of 1 to {_NAME_LIMIT} characters"
    if " " in name:
        return "a name without spaces"
    return None


class PeerDirectory:
    """The directory on a Redis/Valkey server or a Redis Cluster; no call waits past a deadline.

    On a cluster (a `redis+cluster://` URL) each key lives on the master
    serving its slot; redis-py's `RedisCluster` keeps the slot map, groups
    a call's commands by master (one pipeline to each) and follows the
    `MOVED`/`ASK` replies of a failover or a resharding. It is built at
    the first call (and again at the next call while no seed answers), so a
    cluster that is down at start makes misses, not an engine that fails to
    start. Thread-safe: each call takes pooled connections of its own.

    Every call is waited for at most `lookup_timeout_s`; one that fails or
    runs past it starts an outage, during which calls answer at once
    (see the module's docstring). `is_available` says whether one lasts.
    """

    def __init__(self, settings: RedisStoreSettings, ttl_s: float) -> None:
        self._settings = settings
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._pool: redis.BlockingConnectionPool | None = None
        self._client: redis.Redis | RedisCluster | None = None
        if not settings.is_cluster:
            kwargs = settings.connection_pool_kwargs()
            self._pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
                **kwargs,
                # One try: a failed call starts an outage, and the probe tries again.
                retry=Retry(NoBackoff(), 0),
            )
            self._client = redis.Redis(connection_pool=self._pool)
        self._prefix = settings.key_prefix
        # Held while a cluster client is built (a slot-map fetch, bounded by
        # the seeds' timeouts): never by a caller that only counts.
        self._client_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._failures = 0
        # A cluster URL may name hundreds of seeds: shown bounded.
        server = shown(settings.display_url) if settings.is_cluster else settings.display_url
        self._outage = OutageTracker(
            f"peer directory at {server}",
            while_down="lookups miss, and announcements and withdrawals wait",
            probe=self._probe,
            errors=_FAILURES,
            describe=lambda error: shown(
                settings.redact(f"{type(error).__name__}: {error}"), limit=200
            ),
            retry_interval_s=settings.retry_interval_s,
            warning_interval_s=settings.warning_interval_s,
            logger=logger,
            thread_name="kvwire-peer-directory",
        )

    @property
    def ttl_s(self) -> float:
        """How long an entry or a peer record lasts unless written again."""
        return self._ttl_ms / 1000

    @property
    def is_available(self) -> bool:
        """False during an outage: calls answer at once without asking the server."""
        return not self._outage.is_down

    # ------------------------------------------------------------ names

    def entry_key(self, fingerprint_hex: str, block_hash: BlockHash) -> str:
        return f"{self._prefix}peer/{fingerprint_hex}/{block_hash.hex()}"

    def peer_key(self, peer: str) -> str:
        return f"{self._prefix}peer-agent/{peer}"

    # ------------------------------------------------------------ entries

    def look_up(self, keys: Sequence[str]) -> list[Location | None]:
        """Each key's location, None where no peer announced it (or the directory is down);
        one round trip to each server."""
        if not keys:
            return []

        def mget() -> list[Any]:
            client = self._connected()
            # On a cluster the keys span slots: one MGET per slot, pipelined to each master.
            if isinstance(client, RedisCluster):
                return list(client.mget_nonatomic(list(keys)))
            return list(client.mget(list(keys)))

        try:
            values = self._call("look-up", mget)
        except ServerUnavailable:
            return [None] * len(keys)
        return [Location.decode(value) if isinstance(value, bytes) else None for value in values]

    def announce(self, entries: Sequence[tuple[str, Location]]) -> bool:
        """Write these entries (each with the directory's expiry); one round trip to each server.

        False when they may not have been written (the directory is down,
        failed, or did not answer in time): the caller announces them again later.
        """
        if not entries:
            return True
        commands = [
            ("SET", key, location.encode(), "PX", self._ttl_ms) for key, location in entries
        ]
        try:
            self._call("announcement", lambda: self._execute(commands))
        except ServerUnavailable:
            return False
        return True

    def withdraw(self, entries: Sequence[tuple[str, Location]]) -> int | None:
        """Delete these entries where they still name the same location; how many went.

        None when the directory could not be asked (down, failed, or no
        answer in time): the entries may still be there. A withdrawal can be
        made again at any later time, as it deletes only an entry that still
        names the same peer, slot and generation.
        """
        if not entries:
            return 0
        commands = [
            ("EVAL", _COMPARE_AND_DELETE, 1, key, location.encode()) for key, location in entries
        ]
        try:
            replies = self._call("withdrawal", lambda: self._execute(commands))
        except ServerUnavailable:
            return None
        return sum(reply for reply in replies if isinstance(reply, int))

    # ------------------------------------------------------------ peers

    def publish_peer(self, peer: str, record: PeerRecord) -> bool:
        """Write (or refresh) `peer`'s record, with the directory's expiry; False on failure."""
        command = ("SET", self.peer_key(peer), record.encode(), "PX", self._ttl_ms)
        try:
            self._call("peer record", lambda: self._execute([command]))
        except ServerUnavailable:
            return False
        return True

    def fetch_peer(self, peer: str) -> PeerRecord | None:
        """`peer`'s record, None when it has none (never was, or expired) or it cannot be read."""
        try:
            (value,) = self._call(
                "peer look-up", lambda: self._execute([("GET", self.peer_key(peer))])
            )
        except ServerUnavailable:
            return None
        return PeerRecord.decode(value) if isinstance(value, bytes) else None

    def withdraw_peer(self, peer: str) -> None:
        with contextlib.suppress(ServerUnavailable):
            self._call("peer withdrawal", lambda: self._execute([("DEL", self.peer_key(peer))]))

    def _call(self, what: str, work: Callable[[], _T]) -> _T:
        """`work()`, waited for at most `lookup_timeout_s`; every call not made is counted."""
        try:
            seconds = self._settings.lookup_timeout_s
            return self._outage.call(
                what, work, timeout_s=seconds, setting=f"lookup_timeout_s={seconds:g}s"
            )
        except ServerUnavailable:
            with self._count_lock:
                self._failures += 1
            raise

    def _execute(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The replies to `commands`, each naming one key, pipelined; raises on any failure.

        Every command names one key, so on a cluster each goes to the master
        of its slot. A reply that is an error (a slot no master serves, a
        node that failed mid-call) fails the whole call: a directory that
        answers only in part is treated as one that did not answer.
        """
        pipeline = self._connected().pipeline(transaction=False)
        for command in commands:
            pipeline.execute_command(*command)
        replies: list[Any] = pipeline.execute(raise_on_error=True)
        return replies

    def _connected(self) -> redis.Redis | RedisCluster:
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._client is None:
                # Reads the slot map from the seeds: raises when none answers.
                self._client = RedisCluster(
                    **self._settings.cluster_client_kwargs(),
                    # One try: a failed call is a miss, not a wait for the
                    # cluster to come back (redis-py's default retries).
                    retry=Retry(NoBackoff(), 0),
                )
            return self._client

    def _probe(self) -> None:
        """The reconnect probe, on the tracker's thread: raises unless every master answers.

        Bounded by the socket and connect timeouts. On a cluster, a node that
        fails makes redis-py fetch the slot map again, so the probe after a
        failover asks the promoted replica.
        """
        client = self._connected()
        if isinstance(client, RedisCluster):
            client.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            client.ping()

    # ------------------------------------------------------------ upkeep

    def take_failures(self) -> int:
        """How many calls were not made or not answered since the last call."""
        with self._count_lock:
            failures, self._failures = self._failures, 0
        return failures

    def close(self) -> None:
        self._outage.close()
        if self._pool is not None:
            self._pool.disconnect()
        elif self._client is not None:
            self._client.close()
