"""A reusable connector over any :class:`~kvwire.media.store.base.BlockStore`.

The scheduler side decides, the worker side moves bytes:

- scheduler side: looks up the request's ``block_hashes`` beyond what the
  engine has locally (``BlockStore.count_prefix``: only a consecutive prefix
  that is really present counts), plans loads and saves, and ships them in a
  picklable :class:`StoreConnectorMetadata` each step;
- worker side (:class:`~kvwire.media.store._handler.StoreWorker`): moves
  blocks straight between the KV cache's block ranges and the store (an
  entry is the ``block_format`` header, then every layer's block), on
  background threads: the forward pass only submits. A loaded entry is
  verified where it landed, in the cache, before its block counts as
  loaded; failed block ids come back through ``get_block_ids_with_load_errors``
  and the engine computes those blocks again.

Blocks being saved are read in place, so they are kept unchanged until the
save ends: a finished request whose saves may still run keeps its blocks
(``request_finished`` returns True) until the worker reports it finished
sending, and ``handle_preemptions`` (before each forward pass) releases the
saves of preempted requests and any save still reading a block given to a
request since the last step (a sliding window moved on, a request was
preempted: the engine frees such blocks without a call, and the step may
write them): a released save commits nothing more.

How a subclass supplies its store
---------------------------------
Subclass :class:`StoreConnector` and implement :meth:`StoreConnector.create_store`;
declare your own ``kv_connector_extra_config`` keys by extending
:meth:`StoreConnector.extra_config_keys`. Both roles call ``create_store`` (the
scheduler side for lookups, the worker side for reads and writes), each with
the validated options::

    class MyConnector(StoreConnector):
        medium = "mystore"

        @classmethod
        def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
            return (*super().extra_config_keys(), str_key("url", None, required=True))

        def create_store(self, options: Mapping[str, Any]) -> BlockStore:
            return MyStore(options["url"])

Optionally override :meth:`StoreConnector.store_key` (the default is
``group_layouts[group].key(block_hash)``: the KV cache group's layout
fingerprint + block hash; override :meth:`StoreConnector.block_hash_of`, its
inverse, with it) and
:meth:`StoreConnector.store_counters` (extra stats from your store), and give
your store a ``discard(keys)`` so entries found corrupt stop being hits. The
store must never raise into the engine: misses and failures are results.

Hybrid models (several KV cache groups): an entry holds one block of every
layer of one group, keyed and headed with that group's layout (its name is
in the fingerprint), so two groups' entries for one block hash never share a
key and one never loads into the other. With a single group the keys are
those of earlier versions. ``store_key(block_hash)`` overrides written for
one group keep working with one group; a hybrid engine calls
``store_key(block_hash, group)``, and refuses at construction an override
that cannot take ``group``.

KV cache events (``medium`` names the store in them): the worker side
reports ``BlockStored`` for the blocks each save really stored (not the
dropped or failed ones) and ``BlockRemoved`` for the corrupt entries it
discarded and for those the store's ``take_removed_keys`` reports (a size
cap); the scheduler side's ``take_events`` returns them once.

Common ``kv_connector_extra_config`` keys: ``staging_buffer_bytes`` (no
staging memory any more: the bytes of entries that saves in flight may hold;
a save beyond it is dropped and counted, never waited for), ``io_threads``
(per direction), ``batch_blocks`` (blocks per save job, and the shortest load
run: a load is shared between the I/O
threads in runs of at least this many blocks, one store call each),
``async_load`` (loads reported through ``get_finished``), ``transfer_timeout_s``
(default 30: the deadline of each load and save, from its start; a load
still running then is abandoned and its blocks are load errors, which the
engine computes again, and never writes into the cache afterwards; a save
still running then counts failed), ``mac_key_env``
(the name of an environment variable holding a MAC key: every entry is then
sealed with HMAC-SHA256 and one whose MAC does not match is a load error, see
:mod:`kvwire.blocks.mac`; the key itself is never accepted in a
profile).
"""

from __future__ import annotations

import abc
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.mac import EntryMac, MacKeyError
from kvwire.blocks.transfers import BlockTransfer
from kvwire.connector.base import KVConnectorMetadata, KVConnectorRole
from kvwire.connector.types import (
    BlockHash,
    ForwardContext,
    KVCacheBlocks,
    KVCacheEvent,
    KVConnectorOutput,
    KVConnectorStats,
    Request,
    SchedulerOutput,
)
from kvwire.connector.worker_steps import metadata_of_type
from kvwire.connectors.offload._block_connector import BlockConnector
from kvwire.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    bool_key,
    int_key,
    seconds_key,
    size_key,
)
from kvwire.media.store._handler import LATE_WRITE_GRACE_S, StoreWorker

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvwire.config import EngineConfig, KVTransferConfig
    from kvwire.kv_cache_config import KVCacheConfig
    from kvwire.media.store.base import BlockStore

logger = logging.getLogger(__name__)

__all__ = ["StoreConnector", "StoreConnectorMetadata"]

# Not a declared key, so a user's extra config can never supply it.
_ENTRY_MAC = "entry_mac"


@attrs.frozen
class _Unchecked:
    """``mac_key_env`` as given: checked by :meth:`StoreConnector.read_options`, never echoed.

    The generic reader would print a bad value, and a bad value here may be
    the key itself.
    """

    value: object = attrs.field(repr=False)


@attrs.frozen
class StoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan: blocks to load (now or in the background) and to save.

    ``release_req_ids``: finished requests that kept their blocks (a save or
    an asynchronous load may still use them); the worker reports them
    finished sending once none does. ``preempted_req_ids``: requests whose
    blocks the engine took back; their saves end before the forward pass.
    ``new_block_ids``: block ids given to requests since the last step, to be
    written from this step on; saves still reading one end before it.
    ``lookup_hit_blocks``/``lookup_miss_blocks`` carry the scheduler side's
    lookup counts to the worker side, which reports all stats.
    """

    loads: tuple[BlockTransfer, ...] = ()
    async_loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()
    release_req_ids: tuple[str, ...] = ()
    preempted_req_ids: tuple[str, ...] = ()
    new_block_ids: frozenset[int] = frozenset()
    lookup_hit_blocks: int = 0
    lookup_miss_blocks: int = 0


class StoreConnector(BlockConnector[StoreWorker]):
    """A connector that keeps encoded KV blocks in a :class:`BlockStore`.

    Abstract: a subclass supplies the store through :meth:`create_store`.
    Loads happen only for ``kv_consumer``/``kv_both`` engines, saves only for
    ``kv_producer``/``kv_both`` ones.
    """

    medium: str = "store"

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        # Both sides: sealed entries are named apart (the key's id is in the fingerprint).
        self._layout = attrs.evolve(self._layout, mac=self._options[_ENTRY_MAC])
        # Once, after the MAC: keys and headers index these, never rebuild them.
        self._group_layouts = super().group_layouts
        self._key_of = self._group_key_function()
        self._store = self.create_store(self._options)
        # Scheduler side.
        self._step_loads: list[BlockTransfer] = []
        self._step_async_loads: list[BlockTransfer] = []
        self._async_loading: set[str] = set()
        # Requests with saves planned: their blocks are kept when they finish.
        self._saving: set[str] = set()
        self._release_req_ids: list[str] = []
        self._events: list[KVCacheEvent] = []

    # ------------------------------------------------------- subclass hooks

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        """The ``kv_connector_extra_config`` keys this connector accepts."""
        return (
            # Allocates nothing now (a bound on saves in flight): no memory check.
            size_key("staging_buffer_bytes", 64 * 1024**2),
            int_key("io_threads", 4, minimum=1, maximum=64),
            int_key("batch_blocks", 8, minimum=1, maximum=4096),
            bool_key("async_load", False),
            seconds_key("transfer_timeout_s", 30.0, maximum=24 * 3600),
            ExtraConfigKey(
                "mac_key_env",
                None,
                _Unchecked,
                "the name of an environment variable holding a MAC key",
            ),
        )

    @classmethod
    def read_options(cls, kv_transfer_config: KVTransferConfig) -> dict[str, Any]:
        """The common options, and the MAC keyed from ``mac_key_env`` as ``options["entry_mac"]``.

        An unset, empty or too short variable is an error here, so ``kvwire
        check`` (run in the engine's environment) finds it before the engine.
        """
        options = super().read_options(kv_transfer_config)
        given = options["mac_key_env"]
        try:
            entry_mac = None if given is None else EntryMac.from_environment(given.value)
        except MacKeyError as error:
            raise ExtraConfigError(f"kv_connector_extra_config.mac_key_env: {error}") from None
        return {**options, _ENTRY_MAC: entry_mac}

    @abc.abstractmethod
    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        """The store this connector uses, from its validated extra-config ``options``."""

    def store_key(self, block_hash: BlockHash, group: int = 0) -> str:
        """The store key of a block of KV cache ``group``: its layout's fingerprint, then the hash.

        With a single group, the key is ``layout.key(block_hash)``, as before
        groups existed. An override for hybrid engines must take ``group``
        (see the module).
        """
        return self._group_layouts[group].key(block_hash)

    def block_hash_of(self, key: str) -> BlockHash | None:
        """The block hash :meth:`store_key` made ``key`` from, in any group; None for another's."""
        for layout in self._group_layouts:
            block_hash = layout.block_hash_of(key)
            if block_hash is not None:
                return block_hash
        return None

    @property
    def group_layouts(self) -> tuple[BlockLayout, ...]:
        return self._group_layouts

    def _group_key_function(self) -> Callable[[int, BlockHash], str]:
        """How this connector names a block of a group: through :meth:`store_key`, overrides too.

        A single-group engine calls ``store_key(block_hash)``, so an override
        written before groups existed keeps its keys; a hybrid engine needs
        one that takes ``group``.
        """
        if len(self._groups) == 1:
            return lambda group, block_hash: self.store_key(block_hash)
        try:
            inspect.signature(self.store_key).bind(b"", 0)
        except TypeError:
            raise TypeError(
                f"{type(self).__name__}.store_key takes only a block hash, and this "
                f"kv_cache_config has {len(self._groups)} KV cache groups; expected "
                "store_key(block_hash, group), naming each group's blocks apart "
                "(or set disable_hybrid_kv_cache_manager: true)"
            ) from None
        return lambda group, block_hash: self.store_key(block_hash, group)

    def store_counters(self) -> Mapping[str, float]:
        """Extra counters from the store, reported with the stats (then reset)."""
        return {}

    def late_write_grace_s(self) -> float:
        """How long a given-up load's read already under way may take to return.

        Longer than any single read the store can make: past it the engine
        stops (``LateWriteError``) rather than let the read land late. A
        store whose reads are bounded by a longer timeout raises it.
        """
        return LATE_WRITE_GRACE_S

    @property
    def store(self) -> BlockStore:
        return self._store

    # -------------------------------------------------------- scheduler side

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """Only a consecutive prefix that is really in the store, under ``group``'s keys, counts."""
        return self._store.count_prefix([self._key_of(group, h) for h in block_hashes])

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        loads = self._planner.allocate(request, blocks, num_external_tokens)
        if not loads:
            return
        if self._async_load:
            self._async_loading.add(request.request_id)
            self._step_async_loads.extend(loads)
        else:
            self._step_loads.extend(loads)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreConnectorMetadata:
        saves = tuple(self._planner.plan_saves(scheduler_output))
        self._saving.update(save.request_id for save in saves)
        for request_id in scheduler_output.finished_req_ids:
            self._planner.forget(request_id)
        hit_blocks, miss_blocks = self._planner.take_lookup_counts()
        metadata = StoreConnectorMetadata(
            loads=tuple(self._step_loads),
            async_loads=tuple(self._step_async_loads),
            saves=saves,
            release_req_ids=tuple(self._release_req_ids),
            preempted_req_ids=tuple(sorted(scheduler_output.preempted_req_ids)),
            new_block_ids=frozenset(self._planner.take_new_block_ids()),
            lookup_hit_blocks=hit_blocks,
            lookup_miss_blocks=miss_blocks,
        )
        self._step_loads = []
        self._step_async_loads = []
        self._release_req_ids = []
        return metadata

    def _keeps_blocks_when_finished(self, request: Request) -> bool:
        """While its saves may still read its blocks, or a background load write into them.

        Saves read the blocks in place in the background, so a request with
        saves planned keeps its blocks until the worker reports it finished
        sending (the step after its saves end); so does one aborted while loading.
        """
        self._planner.forget(request.request_id)
        saving = request.request_id in self._saving
        self._saving.discard(request.request_id)
        if saving or request.request_id in self._async_loading:
            self._release_req_ids.append(request.request_id)
            return True
        return False

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._async_loading -= connector_output.finished_recving or set()
        self._planner.loads_failed(connector_output.invalid_block_ids)
        # Only the worker side sees the store change; this side hands its events on.
        self._events.extend(connector_output.kv_cache_events)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    # ----------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvwire.blocks.memory import group_memories

        # At least one block's save may be in flight, whatever the bound.
        max_save_bytes = max(self._options["staging_buffer_bytes"], self._layout.entry_bytes)
        self._worker = StoreWorker(
            store=self._store,
            layouts=self._group_layouts,
            memories=group_memories(kv_caches, self._layout, self._groups),
            io_threads=self._options["io_threads"],
            batch_blocks=self._options["batch_blocks"],
            max_save_bytes=max_save_bytes,
            counters=self._counters,
            key_of=self._key_of,
            hash_of=self.block_hash_of,
            medium=self.medium,
            transfer_timeout_s=self._options["transfer_timeout_s"],
            late_write_grace_s=self.late_write_grace_s(),
        )
        logger.info(
            "%s: %s store, %d KV cache group(s), blocks of %d bytes, saves in flight up to "
            "%d bytes, %d I/O threads per direction",
            type(self).__name__,
            self.medium,
            len(self._groups),
            self._layout.payload_bytes,
            max_save_bytes,
            self._options["io_threads"],
        )

    def _metadata(self) -> StoreConnectorMetadata:
        return metadata_of_type(
            type(self).__name__, self._get_connector_metadata(), StoreConnectorMetadata
        )

    def _release_saves(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Release the saves that read blocks the coming forward pass may write.

        Those of preempted requests, and those still reading a block given to
        a request since the last step (freed unannounced: a sliding window
        moved on, a request was preempted). A save not started is cancelled;
        one under way commits nothing more (its gate closes), so no entry is
        ever made from a block being overwritten; nothing waits for its I/O.
        Their blocks count as ``saves_released``.
        """
        metadata = metadata_of_type(
            type(self).__name__, kv_connector_metadata, StoreConnectorMetadata
        )
        self._require_worker().release_saves_reading(
            metadata.preempted_req_ids, metadata.new_block_ids
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._metadata()
        self._release_saves_once(metadata)
        self._counters.add_many(
            {
                "lookup_hit_blocks": metadata.lookup_hit_blocks,
                "lookup_miss_blocks": metadata.lookup_miss_blocks,
            }
        )
        self._pending_release.add(metadata.release_req_ids)
        if metadata.loads or metadata.async_loads:
            self._require_worker().start_loads(metadata.loads, metadata.async_loads)

    def wait_for_save(self) -> None:
        # Only submits: the saves read the blocks in place, in the background.
        metadata = self._metadata()
        worker = self._require_worker()
        saves, _left_out = self._saves_from_good_context(metadata.saves)
        if saves:
            worker.save(saves)

    def transfers_running(self, request_id: str) -> bool:
        """A finished request's blocks stay kept while its saves (or a load) run."""
        worker = self._worker
        return worker is not None and (
            worker.is_loading(request_id) or worker.saves_running(request_id)
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            self._worker.expire_overdue_saves()  # so this step's stats count them
        self._counters.add_many(self.store_counters())
        return self._counters.take_stats()

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        return self._worker.take_events() if self._worker is not None else []

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        """Block until every save submitted so far is in the store (or failed)."""
        return self._worker.wait_for_saves(timeout_s) if self._worker is not None else True

    def shutdown(self) -> None:
        try:
            if self._worker is not None:
                self._worker.close()
        finally:
            self._store.close()
