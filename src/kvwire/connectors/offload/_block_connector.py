"""The base of kvwire's connectors that move whole blocks, every layer at once, by hash.

The CPU-offload connector and the store connectors differ in where blocks
live (a CPU pool, a :class:`~kvwire.media.store.base.BlockStore`) and in their
worker classes, and share everything around that:

- the block layout, checked against the engine's caches, and the validated
  ``kv_connector_extra_config`` (each subclass declares its keys; every one
  has ``async_load``), read by the same code when ``kvwire check`` validates
  a profile;
- the scheduler side's planning (:class:`~kvwire.connectors.offload._planner.BlockPlanner`):
  a subclass only says how many consecutive blocks its medium holds;
- the worker side's per-layer calls: loads write every layer at once, so the
  first layer waits for them; saves copy every layer after the forward pass,
  so ``save_kv_layer`` does nothing; finished requests whose blocks were kept
  are reported once their transfers end.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import attrs

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import cache_groups, layers_per_group
from kvwire.blocks.paged_cache import check_cache_layout
from kvwire.blocks.transfers import BlockTransfer
from kvwire.connector.base import (
    ConnectorResolver,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from kvwire.connector.counters import Counters
from kvwire.connector.types import BlockHash, Request
from kvwire.connector.worker_steps import (
    PendingRelease,
    registered_worker,
    saves_from_good_context,
)
from kvwire.connectors.offload._planner import BlockPlanner
from kvwire.extra_config import ExtraConfigKey, read_extra_config

if TYPE_CHECKING:
    import torch

    from kvwire.config import EngineConfig, KVTransferConfig
    from kvwire.kv_cache_config import KVCacheConfig


class BlockWorker(Protocol):
    """What the shared worker-side calls need of a connector's worker."""

    def wait_for_loads(self) -> None: ...

    def take_finished_loads(self) -> set[str]: ...

    def take_load_errors(self) -> set[int]: ...

    def load_errors_so_far(self) -> set[int]: ...


_Worker = TypeVar("_Worker", bound=BlockWorker)


class BlockConnector(KVConnectorBase, SupportsHMA, Generic[_Worker]):
    """A connector that loads and saves full blocks of every layer, keyed by block hash.

    It serves hybrid models (several KV cache groups): an entry holds one
    block of every layer of one group, named by the group's own layout
    (:attr:`group_layouts`), and the planner moves per group only the blocks
    that group needs.

    Abstract: a subclass declares its :meth:`extra_config_keys`, counts the
    blocks its medium holds (:meth:`count_held_prefix`), builds its worker in
    ``register_kv_caches`` (``self._worker``) and says while a request's
    transfers still run (:meth:`transfers_running`). Loads happen only for
    ``kv_consumer``/``kv_both`` engines, saves only for ``kv_producer``/``kv_both`` ones.
    """

    # False: a sliding-window group saves every block, as a connector unaware
    # of windows would (the figure ``--only hybrid`` measures against).
    window_aware_saves: ClassVar[bool] = True

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self._groups = cache_groups(kv_cache_config)
        self._layout = attrs.evolve(
            BlockLayout.from_engine_config(config), num_layers=layers_per_group(self._groups)
        )
        check_cache_layout(self._layout, kv_cache_config)
        self._options = self.read_options(self.kv_transfer_config)
        self._async_load: bool = self._options["async_load"]
        # Scheduler side.
        self._planner = BlockPlanner(
            self._layout.block_size,
            self._groups,
            loads=self.kv_transfer_config.is_kv_consumer,
            window_aware=self.window_aware_saves,
            saves=self.kv_transfer_config.is_kv_producer,
        )
        # Worker side.
        self._counters = Counters()
        self._pending_release = PendingRelease()
        self._worker: _Worker | None = None
        self._failed_elsewhere: set[int] = set()
        self._step_released_for: KVConnectorMetadata | None = None

    @classmethod
    @abc.abstractmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        """The ``kv_connector_extra_config`` keys it accepts, ``async_load`` among them."""

    @classmethod
    def read_options(cls, kv_transfer_config: KVTransferConfig) -> dict[str, Any]:
        """The checked ``kv_connector_extra_config``, defaults filled in (or ``ExtraConfigError``).

        The constructor and :meth:`validate_extra_config` both read through
        it, so ``kvwire check`` and the engine reject the same values; only
        what needs the engine itself (a CPU pool too small for one block of
        this model, a directory that cannot be created) waits for the
        constructor. A subclass may extend it (Redis checks its settings
        together here) but must stay free of side effects: it runs at check
        time too.
        """
        return read_extra_config(
            cls.__name__, kv_transfer_config.kv_connector_extra_config, cls.extra_config_keys()
        )

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: ConnectorResolver
    ) -> None:
        """Reads the options as the constructor does, and drops them: nothing is built."""
        cls.read_options(kv_transfer_config)

    @abc.abstractmethod
    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the medium holds for ``group``.

        Scheduler side. A sliding-window group's window is asked for last
        block first (see :class:`~kvwire.connectors.offload._planner.BlockPlanner`).
        """

    @abc.abstractmethod
    def transfers_running(self, request_id: str) -> bool:
        """Whether a transfer of ``request_id`` still uses its blocks (worker side)."""

    @property
    def layout(self) -> BlockLayout:
        """The layout of one entry, whatever its group (the groups differ only in their name)."""
        return self._layout

    @property
    def group_layouts(self) -> tuple[BlockLayout, ...]:
        """Each KV cache group's layout: the group's name is in its fingerprint.

        With a single group, just :attr:`layout`, so its entries keep their names.
        """
        if len(self._groups) == 1:
            return (self._layout,)
        return tuple(attrs.evolve(self._layout, group=group.name) for group in self._groups)

    # -------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hits = self._planner.look_up(request, num_computed_tokens, self.count_held_prefix)
        return hits * self._layout.block_size, self._async_load and hits > 0

    @abc.abstractmethod
    def _keeps_blocks_when_finished(self, request: Request) -> bool:
        """Forget the finished ``request``; whether its blocks, in every group, must be kept.

        True while a transfer still reads or writes them; the worker side
        then reports the request finished sending once it no longer does.
        """

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._keeps_blocks_when_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Not through request_finished: the engine makes one finishing call per
        # request, and a wrapper recording calls must see one.
        return self._keeps_blocks_when_finished(request), None

    # ----------------------------------------------------------- worker side

    def _require_worker(self) -> _Worker:
        return registered_worker(type(self).__name__, self._worker)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Synchronous loads write every layer at once; the first layer waits.
        if self._worker is not None:
            self._worker.wait_for_loads()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Blocks are copied out in wait_for_save, all layers at once, so each
        # block is copied once, into one contiguous entry.
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        received = self._worker.take_finished_loads()
        sent = self._pending_release.take_released(self.transfers_running)
        return (sent or None), (received or None)

    def load_errors_this_step(self) -> set[int]:
        """Block ids whose synchronous loads failed this step; waits for the loads to end.

        A composite asks each child, and tells every child
        (:meth:`skip_saves_computed_from`): whichever child loaded a block,
        every child saves what was computed from it.
        """
        worker = self._require_worker()
        worker.wait_for_loads()
        return worker.load_errors_so_far()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Release the saves still reading blocks this step may write (see :meth:`_release_saves`).

        vLLM and kvwire's engine call it before the forward pass; an engine
        that does not gets it from ``start_load_kv``, once per step either way.
        """
        self._step_released_for = kv_connector_metadata
        self._release_saves(kv_connector_metadata)

    def _release_saves_once(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if kv_connector_metadata is not self._step_released_for:
            self.handle_preemptions(kv_connector_metadata)

    @abc.abstractmethod
    def _release_saves(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Release the saves reading blocks of preempted requests or blocks given out again."""

    def skip_saves_computed_from(self, block_ids: set[int]) -> None:
        """In this step's :meth:`wait_for_save`, save nothing computed from these blocks."""
        self._failed_elsewhere |= block_ids

    def _saves_from_good_context(
        self, saves: Sequence[BlockTransfer]
    ) -> tuple[list[BlockTransfer], list[BlockTransfer]]:
        """This step's saves to make, and those computed from a failed load (counted)."""
        failed = self.load_errors_this_step() | self._failed_elsewhere
        self._failed_elsewhere = set()
        kept, left_out = saves_from_good_context(saves, failed)
        if left_out:
            skipped = sum(len(save.block_ids) for save in left_out)
            self._counters.add("saves_skipped_after_failed_load", skipped)
        return kept, left_out

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()
