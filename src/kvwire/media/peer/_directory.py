"""The peers' directory: which peer holds which block, and how to reach each peer, in Redis.

Two kinds of small keys, both with an expiry (``directory_ttl_s``):

- an *entry* per block a peer holds,
  ``<key_prefix>peer/<layout fingerprint>/<block hash>`` ->
  ``<peer name> <slot> <generation>``: written by the holder's scheduler
  side once the block's store completed (and written again while its pool
  holds the block, before it expires), deleted when the holder evicts
  the block, and deleted by a reader whose read of it failed. The layout
  fingerprint (model, dtype, shape, cache layout, KV cache group) is in
  the name (of a split engine, the whole split's: every rank's share), so
  engines of another model, layout or split never find each other's
  blocks;
- a *peer record* per live worker, ``<key_prefix>peer-agent/<agent name>``
  (the peer's name; each rank's, ``<peer name> rank<r>``, in a split engine):
  its NIXL agent's metadata and where its pool lies, refreshed by the
  worker while it runs. A peer that died stops refreshing it: its record
  expires, and readers then treat its entries as gone (and delete them).

Deletes are compare-and-delete (a server-side script): an entry is
deleted only while it still names the same peer, slot and generation, so a
reader's late delete never removes a newer announcement of the block.

The directory is a cache's index, not a source of truth: when the server
cannot be reached, lookups miss and announcements are dropped (counted as
``peer_directory_failures``); a read always verifies the bytes it pulled.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvwire.interface.types import BlockHash
from kvwire.media._rate_limited import RateLimitedWarning
from kvwire.media.store.redis._settings import RedisStoreSettings

logger = logging.getLogger(__name__)

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
        """The location ``value`` names, or None for a value no peer writes."""
        try:
            peer, slot, generation = value.decode("ascii").split(" ")
            return cls(peer, int(slot), int(generation))
        except (UnicodeDecodeError, ValueError):
            return None


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
        """The address of ``slot``'s entry in the peer's memory; None if it has no such slot."""
        if not 0 <= slot < self.num_slots:
            return None
        return self.base_address + slot * self.entry_bytes


def check_peer_name(name: str) -> str | None:
    """None when ``name`` can name a peer, else what is accepted."""
    if not name or len(name) > _NAME_LIMIT or not name.isascii() or not name.isprintable():
        return f"printable ASCII of 1 to {_NAME_LIMIT} characters"
    if " " in name:
        return "a name without spaces"
    return None


class PeerDirectory:
    """The directory on a Redis/Valkey server or a Redis Cluster; calls bounded by socket timeouts.

    On a cluster (a ``redis+cluster://`` URL) each key lives on the master
    serving its slot; redis-py's ``RedisCluster`` keeps the slot map, groups
    a call's commands by master (one pipeline to each) and follows the
    ``MOVED``/``ASK`` replies of a failover or a resharding. It is built at
    the first call (and again at the next call while no seed answers), so a
    cluster that is down at start makes misses, not an engine that fails to
    start. Thread-safe: each call takes pooled connections of its own.
    """

    def __init__(self, settings: RedisStoreSettings, ttl_s: float) -> None:
        self._settings = settings
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._pool: redis.BlockingConnectionPool | None = None
        self._client: redis.Redis | RedisCluster | None = None
        if not settings.is_cluster:
            kwargs = settings.connection_pool_kwargs()
            self._pool = redis.BlockingConnectionPool(**kwargs)  # type: ignore[no-untyped-call]
            self._client = redis.Redis(connection_pool=self._pool)
        self._prefix = settings.key_prefix
        self._warn = RateLimitedWarning(logger)
        self._lock = threading.Lock()
        self._failures = 0

    @property
    def ttl_s(self) -> float:
        """How long an entry or a peer record lasts unless written again."""
        return self._ttl_ms / 1000

    # ------------------------------------------------------------ names

    def entry_key(self, fingerprint_hex: str, block_hash: BlockHash) -> str:
        return f"{self._prefix}peer/{fingerprint_hex}/{block_hash.hex()}"

    def peer_key(self, peer: str) -> str:
        return f"{self._prefix}peer-agent/{peer}"

    # ------------------------------------------------------------ entries

    def look_up(self, keys: Sequence[str]) -> list[Location | None]:
        """Each key's location, None where no peer announced it; one round trip to each server."""
        if not keys:
            return []
        try:
            client = self._connected()
            # On a cluster the keys span slots: one MGET per slot, pipelined to each master.
            if isinstance(client, RedisCluster):
                values = client.mget_nonatomic(list(keys))
            else:
                values = client.mget(list(keys))
        except _FAILURES as error:
            self._failed("look-up", error)
            return [None] * len(keys)
        return [Location.decode(value) if isinstance(value, bytes) else None for value in values]

    def announce(self, entries: Sequence[tuple[str, Location]]) -> None:
        """Write these entries (each with the directory's expiry); one round trip to each server."""
        if not entries:
            return
        try:
            self._execute(
                [("SET", key, location.encode(), "PX", self._ttl_ms) for key, location in entries]
            )
        except _FAILURES as error:
            self._failed("announcement", error)

    def withdraw(self, entries: Sequence[tuple[str, Location]]) -> int:
        """Delete these entries where they still name the same location; how many went."""
        if not entries:
            return 0
        try:
            replies = self._execute(
                [
                    ("EVAL", _COMPARE_AND_DELETE, 1, key, location.encode())
                    for key, location in entries
                ]
            )
        except _FAILURES as error:
            self._failed("withdrawal", error)
            return 0
        return sum(reply for reply in replies if isinstance(reply, int))

    # ------------------------------------------------------------ peers

    def publish_peer(self, peer: str, record: PeerRecord) -> bool:
        """Write (or refresh) ``peer``'s record, with the directory's expiry; False on failure."""
        try:
            self._execute([("SET", self.peer_key(peer), record.encode(), "PX", self._ttl_ms)])
            return True
        except _FAILURES as error:
            self._failed("peer record", error)
            return False

    def fetch_peer(self, peer: str) -> PeerRecord | None:
        """``peer``'s record, None when it has none (never was, or expired) or it cannot be read."""
        try:
            (value,) = self._execute([("GET", self.peer_key(peer))])
        except _FAILURES as error:
            self._failed("peer look-up", error)
            return None
        return PeerRecord.decode(value) if isinstance(value, bytes) else None

    def withdraw_peer(self, peer: str) -> None:
        try:
            self._execute([("DEL", self.peer_key(peer))])
        except _FAILURES as error:
            self._failed("peer withdrawal", error)

    def _execute(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The replies to ``commands``, each naming one key, pipelined; raises on any failure.

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
        with self._lock:
            if self._client is None:
                # Reads the slot map from the seeds: raises when none answers.
                self._client = RedisCluster(
                    **self._settings.cluster_client_kwargs(),
                    # One try: a failed call is a miss, not a wait for the
                    # cluster to come back (redis-py's default retries).
                    retry=Retry(NoBackoff(), 0),
                )
            return self._client

    # ------------------------------------------------------------ upkeep

    def take_failures(self) -> int:
        """How many calls failed (server unreachable, refused) since the last call."""
        with self._lock:
            failures, self._failures = self._failures, 0
        return failures

    def close(self) -> None:
        if self._pool is not None:
            self._pool.disconnect()
        elif self._client is not None:
            self._client.close()

    def _failed(self, what: str, error: BaseException) -> None:
        with self._lock:
            self._failures += 1
        self._warn.warn(
            f"directory-{what}",
            "peer medium: directory %s failed at %s: %s",
            what,
            self._settings.display_url,
            self._settings.redact(f"{type(error).__name__}: {error}")[:200],
        )
