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

import attrs
import redis

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
    """The directory on one Redis/Valkey server; every call bounded by the socket timeout.

    Thread-safe: redis-py's pool hands each call a connection of its own.
    """

    def __init__(self, settings: RedisStoreSettings, ttl_s: float) -> None:
        self._settings = settings
        self._ttl_ms = max(1, int(ttl_s * 1000))
        kwargs = settings.connection_pool_kwargs()
        self._pool = redis.BlockingConnectionPool(**kwargs)  # type: ignore[no-untyped-call]
        self._client = redis.Redis(connection_pool=self._pool)
        self._compare_and_delete = self._client.register_script(_COMPARE_AND_DELETE)
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
        """Each key's location, None where no peer announced it; one round trip."""
        if not keys:
            return []
        try:
            values = self._client.mget(list(keys))
        except (redis.exceptions.RedisError, OSError) as error:
            self._failed("look-up", error)
            return [None] * len(keys)
        return [Location.decode(value) if isinstance(value, bytes) else None for value in values]

    def announce(self, entries: Sequence[tuple[str, Location]]) -> None:
        """Write these entries (each with the directory's expiry); one round trip."""
        if not entries:
            return
        try:
            pipeline = self._client.pipeline(transaction=False)
            for key, location in entries:
                pipeline.set(key, location.encode(), px=self._ttl_ms)
            pipeline.execute()
        except (redis.exceptions.RedisError, OSError) as error:
            self._failed("announcement", error)

    def withdraw(self, entries: Sequence[tuple[str, Location]]) -> int:
        """Delete these entries where they still name the same location; how many went."""
        if not entries:
            return 0
        try:
            pipeline = self._client.pipeline(transaction=False)
            for key, location in entries:
                self._compare_and_delete(keys=[key], args=[location.encode()], client=pipeline)
            return sum(int(deleted) for deleted in pipeline.execute())
        except (redis.exceptions.RedisError, OSError) as error:
            self._failed("withdrawal", error)
            return 0

    # ------------------------------------------------------------ peers

    def publish_peer(self, peer: str, record: PeerRecord) -> bool:
        """Write (or refresh) ``peer``'s record, with the directory's expiry; False on failure."""
        try:
            self._client.set(self.peer_key(peer), record.encode(), px=self._ttl_ms)
            return True
        except (redis.exceptions.RedisError, OSError) as error:
            self._failed("peer record", error)
            return False

    def fetch_peer(self, peer: str) -> PeerRecord | None:
        """``peer``'s record, None when it has none (never was, or expired) or it cannot be read."""
        try:
            value = self._client.get(self.peer_key(peer))
        except (redis.exceptions.RedisError, OSError) as error:
            self._failed("peer look-up", error)
            return None
        return PeerRecord.decode(value) if isinstance(value, bytes) else None

    def withdraw_peer(self, peer: str) -> None:
        try:
            self._client.delete(self.peer_key(peer))
        except (redis.exceptions.RedisError, OSError) as error:
            self._failed("peer withdrawal", error)

    # ------------------------------------------------------------ upkeep

    def take_failures(self) -> int:
        """How many calls failed (server unreachable, refused) since the last call."""
        with self._lock:
            failures, self._failures = self._failures, 0
        return failures

    def close(self) -> None:
        self._pool.disconnect()

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
