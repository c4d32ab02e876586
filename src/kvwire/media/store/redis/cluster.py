"""A `kvwire.media.BlockStore` on a Redis Cluster (or Valkey cluster).

Keys are spread over every master by hash slot (CRC16 of the whole key, no
hash tag), so a fleet's blocks use every master's memory and network card.
redis-py's `RedisCluster` keeps the slot map (`CLUSTER SLOTS` from any
seed or known node); each call groups its keys by the master serving their
slot and sends each group to its master through a
`RedisBlockStore` of that node: the
same pipelines, zero-copy reads into the caller's buffers (or scattered over
a block's ranges in the KV cache, and values sent from them), checksummed
values, deadlines (`load_timeout_s`...) and outage handling as a single
server. The groups of one call go to their masters in parallel.

Faults stay per node. A master that is down, or past a deadline, makes its
keys misses, dropped saves or load errors, never a hang; the other masters'
keys are served as usual. A lookup asks every master at once, each on a
thread of its node store's, and waits for them under one deadline
(`lookup_timeout_s`): a hung master costs the scheduler that deadline once,
then its keys miss at once until its store's probe hears it again (see
`kvwire.media.outage`). A master that answers `MOVED` or `ASK` (its
slot moved: a failover or a resharding) has its keys treated the same way,
never as another key's value. Either asks a background thread to fetch the
slot map again (at most once per `retry_interval_s`); the calls after it
go to the new owners, so hits resume once a replica has taken over or the
slots have moved. No call waits for the map: a call in flight during a
failover fails its keys at once, and the engine computes those blocks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from kvwire.exceptions import JobAbandoned
from kvwire.media.store.base import CacheWrites
from kvwire.media.store.redis._common import (
    FailureCounts,
    RedisStoreBase,
    add_counts,
    require_one_each,
)
from kvwire.media.store.redis._wire import Deadline, Reply
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings

logger = logging.getLogger(__name__)

_Item = TypeVar("_Item")

_SLOTS = 16384
# Replies that say a key's slot is served elsewhere, or not served right now.
_REDIRECTS = ("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN")
# What a failed slot-map fetch raises: the seeds cannot be reached, or
# answer something that is not a cluster map.
_MAP_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    OSError,
)
# A node call's own deadline ends it; this much more covers the thread hand-off.
_HANDOFF_SLACK_S = 1.0


class _NodeStore(RedisBlockStore):
    """The store of one master: a redirect reply asks for a new slot map instead of a warning."""

    def __init__(self, settings: RedisStoreSettings, on_redirect: Callable[[], None]) -> None:
        super().__init__(settings)
        self._on_redirect = on_redirect

    def _redirected(self, reply: redis.exceptions.ResponseError) -> bool:
        if str(reply).startswith(_REDIRECTS):
            self._on_redirect()
            return True
        return False

    def _execute(
        self,
        commands: Sequence[tuple[Any, ...]],
        deadline: Deadline,
        commit_gate: CacheWrites | None = None,
    ) -> list[Reply]:
        replies = super()._execute(commands, deadline, commit_gate)
        for reply in replies:
            if isinstance(reply, redis.exceptions.ResponseError):
                self._redirected(reply)
        return replies

    def _unlink(self, names: Sequence[str | bytes], deadline: Deadline) -> int:
        # One UNLINK per key: a command naming keys of different slots is
        # refused (CROSSSLOT) by a cluster node.
        replies = self._execute([("UNLINK", name) for name in names], deadline)
        return sum(reply for reply in replies if isinstance(reply, int))


class RedisClusterBlockStore(RedisStoreBase):
    """Encoded KV blocks spread over a Redis Cluster's masters, one key per block.

    Safe to share between threads, processes and hosts, like
    `RedisBlockStore`. Each master
    has its own connection pool of `settings.pool_size` connections.
    """

    def __init__(self, settings: RedisStoreSettings) -> None:
        if not settings.is_cluster:
            raise ValueError("RedisClusterBlockStore needs a redis+cluster:// URL")
        super().__init__(settings)
        self._lock = threading.Lock()
        self._cluster: RedisCluster | None = None
        # The master serving each slot ("host:port"), or None while none does.
        self._owners: list[str | None] = [None] * _SLOTS
        self._nodes: dict[str, _NodeStore] = {}
        self._retired_totals: dict[str, int] = {}
        self._retired_increments: dict[str, int] = {}
        self._retired_removed: list[str] = []
        # Keys no call could send: their slot had no known master.
        self._unmapped = FailureCounts(("lookup_failures", "saves_dropped", "load_failures"))
        self._closed = threading.Event()
        self._refresh_wanted = threading.Event()
        self._map_version = 0
        self._last_map_warning = -float("inf")
        self._fan_out = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.pool_size, thread_name_prefix="kvwire-redis-cluster"
        )
        self._load_slot_map()
        self._refresher = threading.Thread(
            target=self._refresh_when_asked, name="kvwire-redis-cluster-map", daemon=True
        )
        self._refresher.start()

    @property
    def is_available(self) -> bool:
        """True once the slot map is known, every slot has a master, and every master answers."""
        with self._lock:
            nodes = list(self._nodes.values())
            covered = all(owner is not None for owner in self._owners)
        return covered and all(node.is_available for node in nodes)

    @property
    def map_version(self) -> int:
        """How many times the slot map was fetched: grows after a failover or resharding."""
        return self._map_version

    def masters(self) -> list[str]:
        """The `host:port` of every master in the slot map."""
        with self._lock:
            return sorted({owner for owner in self._owners if owner is not None})

    # ------------------------------------------------------------ BlockStore

    def count_prefix(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, the masters hold; within `lookup_timeout_s`.

        Not through the fan-out threads, which loads and saves may all hold
        on a hung master: each master's lookup runs on its store's own
        lookup threads, and all are waited for under one deadline.
        """
        if not keys:
            return 0
        found = [False] * len(keys)
        groups, stores = self._route(keys, "lookup_failures")
        deadline = time.monotonic() + self._settings.lookup_timeout_s
        lookups = [
            (indices, stores[owner], stores[owner].begin_count_prefix(_pick(keys, indices)))
            for owner, indices in groups.items()
        ]
        for indices, store, lookup in lookups:
            # Each node answers for its keys in the order given; the prefix
            # of its keys that it holds is all a lookup needs from it.
            present = store.end_count_prefix(lookup, deadline)
            for index in indices[:present]:
                found[index] = True
        if any(not store.is_available for store in stores.values()):
            # A master is down: perhaps a replica has taken over its slots.
            self._request_refresh()
        present = 0
        while present < len(keys) and found[present]:
            present += 1
        return present

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        require_one_each("put", keys, entries, "entries")
        return self._save(
            keys, lambda store, indices: store.put(_pick(keys, indices), _pick(entries, indices))
        )

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        require_one_each("get_into", keys, buffers, "buffers")
        sizes: list[int | None] = [None] * len(keys)

        def load(store: RedisBlockStore, indices: list[int]) -> None:
            # Each node's GETs are pipelined and read straight into the buffers.
            read = store.get_into(_pick(keys, indices), _pick(buffers, indices))
            for index, size in zip(indices, read, strict=True):
                sizes[index] = size

        self._each_node(keys, load, "load_failures", self._settings.load_timeout_s)
        return sizes

    def write_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        commit_gate: CacheWrites | None = None,
    ) -> list[bool]:
        """As `put`: each master's store sends its values straight from their ranges.

        Each ends its values only while `commit_gate` is open (see
        `RedisBlockStore.write_ranges`).
        """
        require_one_each("write_ranges", keys, ranges_per_key, "entries")
        return self._save(
            keys,
            lambda store, indices: store.write_ranges(
                _pick(keys, indices), _pick(ranges_per_key, indices), commit_gate
            ),
        )

    def _save(
        self, keys: Sequence[str], save_on: Callable[[RedisBlockStore, list[int]], list[bool]]
    ) -> list[bool]:
        """Which keys were stored, each master saving its keys with `save_on(store, indices)`."""
        stored = [False] * len(keys)

        def save(store: RedisBlockStore, indices: list[int]) -> None:
            for index, result in zip(indices, save_on(store, indices), strict=True):
                stored[index] = result

        self._each_node(keys, save, "saves_dropped", self._settings.save_timeout_s)
        return stored

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        """Each master's store scatters its replies over their ranges, the masters in parallel.

        Every master's reads end before the first index is yielded (as
        `get_into`), so nothing is written into a range after it is
        yielded. Once the load is given up on, `writes` stops every master's
        reads, and the `JobAbandoned` is raised here once all have returned.
        """
        require_one_each("read_into_ranges", keys, ranges_per_key, "entries")
        sizes: list[int | None] = [None] * len(keys)
        given_up = threading.Event()

        def load(store: RedisBlockStore, indices: list[int]) -> None:
            landed = store.read_into_ranges(
                _pick(keys, indices), _pick(ranges_per_key, indices), writes
            )
            try:
                for position, size in landed:
                    sizes[indices[position]] = size
            except JobAbandoned:
                # Not raised from here: every master's call is waited for first.
                given_up.set()

        self._each_node(keys, load, "load_failures", self._settings.load_timeout_s)
        if given_up.is_set():
            raise JobAbandoned
        yield from enumerate(sizes)

    def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys`; how many existed. Keys on an unreachable master count as not removed."""
        removed = [0]
        removed_lock = threading.Lock()

        def delete_on(store: RedisBlockStore, indices: list[int]) -> None:
            count = store.delete(_pick(keys, indices))
            with removed_lock:
                removed[0] += count

        self._each_node(keys, delete_on, None, self._settings.lookup_timeout_s)
        return removed[0]

    def discard(self, keys: Sequence[str]) -> None:
        def discard_on(store: RedisBlockStore, indices: list[int]) -> None:
            store.discard(_pick(keys, indices))

        self._each_node(keys, discard_on, None, self._settings.lookup_timeout_s)

    def take_removed_keys(self) -> list[str]:
        with self._lock:
            removed, self._retired_removed = self._retired_removed, []
            nodes = list(self._nodes.values())
        for node in nodes:
            removed.extend(node.take_removed_keys())
        return removed

    def clear(self, under: str = "") -> int:
        """Remove every key under the prefix (+ `under`) on every master; how many."""
        with self._lock:
            nodes = list(self._nodes.values())
        return sum(node.clear(under) for node in nodes)

    def counters(self) -> dict[str, int]:
        """Cumulative failure counters over every master (those retired by a failover too)."""
        with self._lock:
            totals = dict(self._retired_totals)
            nodes = list(self._nodes.values())
        add_counts(totals, self._unmapped.totals())
        for node in nodes:
            add_counts(totals, node.counters())
        return totals

    def take_counters(self) -> dict[str, int]:
        """The non-zero counters since the last call, named as a single server's are."""
        with self._lock:
            increments, self._retired_increments = self._retired_increments, {}
            nodes = list(self._nodes.values())
        add_counts(increments, self._unmapped.take_increments())
        for node in nodes:
            add_counts(increments, node.take_counters())
        return increments

    def close(self) -> None:
        self._closed.set()
        self._refresh_wanted.set()
        # The refresher waits at most one slot-map fetch, itself bounded by
        # the socket timeouts of the seeds it asks.
        self._refresher.join(timeout=self._settings.connect_timeout_s + _HANDOFF_SLACK_S)
        self._fan_out.shutdown(wait=True)
        with self._lock:
            nodes = list(self._nodes.values())
            self._nodes = {}
            cluster, self._cluster = self._cluster, None
        for node in nodes:
            node.close()
        if cluster is not None:
            cluster.close()

    # ------------------------------------------------------------- routing

    def _each_node(
        self,
        keys: Sequence[str],
        work: Callable[[RedisBlockStore, list[int]], None],
        unmapped_counter: str | None,
        timeout_s: float,
    ) -> None:
        """Run `work` once per master with the indices of its keys, the masters in parallel.

        Keys whose slot has no known master are left as they are (misses,
        not stored) and counted under `unmapped_counter`; a new map is asked for.
        """
        groups, stores = self._route(keys, unmapped_counter)
        jobs = list(groups.items())
        if not jobs:
            return
        # The first group runs in the calling thread: a call whose keys are
        # all on one master costs no hand-off.
        waits = [self._fan_out.submit(work, stores[owner], indices) for owner, indices in jobs[1:]]
        try:
            work(stores[jobs[0][0]], jobs[0][1])
        finally:
            bound = timeout_s + self._settings.socket_timeout_s + _HANDOFF_SLACK_S
            for future, (_, indices) in zip(waits, jobs[1:], strict=True):
                try:
                    future.result(timeout=bound)
                except concurrent.futures.TimeoutError:
                    # Never started (every fan-out thread busy): it never
                    # will, so its keys stay misses. One that started ends at
                    # its node call's deadline, and must end before the
                    # caller reuses the buffers it writes.
                    if future.cancel():
                        self._count_unrouted(unmapped_counter, len(indices))
                    else:
                        future.result(timeout=bound)
        if any(not stores[owner].is_available for owner, _ in jobs):
            # A master is down: perhaps a replica has taken over its slots.
            self._request_refresh()

    def _route(
        self, keys: Sequence[str], unmapped_counter: str | None
    ) -> tuple[dict[str, list[int]], dict[str, _NodeStore]]:
        """The indices of `keys` by the master serving their slot, and each master's store.

        Keys whose slot has no known master are in no group: counted under
        `unmapped_counter`, and a new map is asked for.
        """
        groups: dict[str, list[int]] = {}
        unmapped = 0
        with self._lock:
            owners = self._owners
            for index, key in enumerate(keys):
                owner = owners[key_slot(self.redis_key(key).encode())]
                if owner is None:
                    unmapped += 1
                else:
                    groups.setdefault(owner, []).append(index)
            stores = {owner: self._node_store(owner) for owner in groups}
        if unmapped:
            self._request_refresh()
            self._count_unrouted(unmapped_counter, unmapped)
        return groups, stores

    def _count_unrouted(self, counter: str | None, amount: int) -> None:
        if counter is not None:
            self._unmapped.add(counter, amount)

    def _node_store(self, owner: str) -> _NodeStore:
        """The store of the master at `owner` ("host:port"); call with the lock held."""
        store = self._nodes.get(owner)
        if store is None:
            host, _, port = owner.rpartition(":")
            store = _NodeStore(self._settings.node_settings(host, int(port)), self._request_refresh)
            self._nodes[owner] = store
        return store

    # ------------------------------------------------------------ slot map

    def _request_refresh(self) -> None:
        self._refresh_wanted.set()

    def _refresh_when_asked(self) -> None:
        while not self._closed.is_set():
            self._refresh_wanted.wait()
            if self._closed.is_set():
                return
            self._refresh_wanted.clear()
            if not self._load_slot_map() or not self.is_available:
                # Ask again after the retry interval: until a replica has
                # taken over, the map still names the master that is down.
                self._refresh_wanted.set()
            self._closed.wait(self._settings.retry_interval_s)

    def _load_slot_map(self) -> bool:
        """Fetch the slot map from the seeds or known nodes; False (map kept) if none answers."""
        try:
            cluster = self._cluster
            if cluster is None:
                cluster = self._cluster = RedisCluster(**self._settings.cluster_client_kwargs())
            else:
                cluster.nodes_manager.initialize()
            slots = dict(cluster.nodes_manager.slots_cache)
        except _MAP_ERRORS as error:
            now = time.monotonic()
            # The fetch is retried every retry_interval_s: one warning per
            # warning_interval_s says it all.
            if now - self._last_map_warning >= self._settings.warning_interval_s:
                self._last_map_warning = now
                logger.warning(
                    "Redis cluster at %s: no slot map (%s); keys are misses until one is fetched",
                    self._shown_url,
                    self._settings.redact(f"{type(error).__name__}: {error}"),
                )
            return False
        owners: list[str | None] = [None] * _SLOTS
        for slot, nodes in slots.items():
            if nodes:
                owners[slot] = nodes[0].name
        with self._lock:
            self._owners = owners
            self._map_version += 1
            current = {owner for owner in owners if owner is not None}
            retired = [name for name in self._nodes if name not in current]
            for owner in current:
                # Every master has its store from the start: clear() and
                # is_available cover the masters no call has used yet.
                self._node_store(owner)
            stores = [self._nodes.pop(name) for name in retired]
            for store in stores:
                # Its counters and removed keys still count after it is gone.
                add_counts(self._retired_totals, store.counters())
                add_counts(self._retired_increments, store.take_counters())
                self._retired_removed.extend(store.take_removed_keys())
        for store in stores:
            # A call still using it fails its keys as in an outage.
            store.close()
        return True


def _pick(items: Sequence[_Item], indices: Sequence[int]) -> list[_Item]:
    """The items at `indices`, in that order: one master's share of a call's arguments."""
    return [items[index] for index in indices]
