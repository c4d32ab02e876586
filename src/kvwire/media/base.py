"""The medium interface: where an offload connector keeps blocks, as a plug-in.

A medium is a pair of halves, one per connector role, built from one
`kvwire.media.Medium` object per connector instance:

- the scheduler half's `kvwire.media.MediumIndex` answers lookups and keeps the
  bookkeeping of transfers (which slots a load reads, which blocks a save
  writes and whether it succeeded), and reports the KV cache events it sees;
- the worker half's `kvwire.media.TransferHandler` runs transfer jobs between the
  paged KV cache and the medium, off the forward pass, and reports which
  ended and which of their blocks failed (its jobs in flight kept by a
  `kvwire.media.JobLedger`).

The offload connector (`kvwire.connectors.offload`) drives both halves
through this interface only, so a new place to keep blocks is a new medium,
registered by name like a connector (`MediumRegistry.register_medium`, on the
`media` of a `kvwire.ConnectorRegistry`, or the
`kvwire.media` entry-point group), never a new connector. A medium declares its own
`kv_connector_extra_config` keys; a connector's profile names it with
`kv_connector_extra_config.medium`.

Every record of blocks to move is a `kvwire.media.BlockTransfer`. What a
medium's scheduler half tells its worker half beyond the blocks travels as one
`kvwire.media.TransferPayload` of the medium's own, which the connector
carries untouched: with a load (`kvwire.media.LoadSpec`, from `prepare_load`), or
with a step's plan (`take_step_payload`, to `TransferHandler.begin_step`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer, TransferPayload
from kvwire.config import ParallelConfig
from kvwire.config.extra_config import ExtraConfigKey
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash, KVCacheEvent

if TYPE_CHECKING:
    import torch

__all__ = [
    "JobResult",
    "LoadSpec",
    "Medium",
    "MediumContext",
    "MediumIndex",
    "TransferHandler",
    "TransferJob",
    "TransferKind",
]


@attrs.frozen
class MediumContext:
    """What a medium is built from, the same in both roles."""

    connector_name: str
    """The connector's class name, for messages and logs."""
    options: Mapping[str, Any] = attrs.field(repr=False)
    """The validated `kv_connector_extra_config`, defaults filled in, the medium's keys too."""
    groups: tuple[CacheGroup, ...]
    """The engine's KV cache groups, in group order."""
    layout: BlockLayout
    """The layout of one entry of any group (one block of every layer of a group)."""
    engine_id: str = ""
    """The engine's `kv_transfer_config.engine_id`: the same in both roles and every process."""
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    """This rank and how the engine is split: `layout` is one rank's share of a block."""
    plugins: Mapping[str, Any] = attrs.field(factory=dict)
    """The class each plug-in option names, by key (the CPU pool's `eviction`: its policy).

    A list-of-media option (the tiered medium's `tiers`) holds a tuple of
    `kvwire.config.extra_config.ResolvedMedium`.

    The options are the medium's keys with a `plugin` lookup (`ExtraConfigKey.plugin`);
    the container resolves them through its registry, so a policy registered or
    overridden on the container's registry is the one handed in. A context built by
    hand passes them itself.
    """


@attrs.frozen
class LoadSpec:
    """What `kvwire.media.MediumIndex.prepare_load` gives a load.

    The connector puts both on the load's `kvwire.media.BlockTransfer` for
    the worker half, and hands `payload` back to `complete_load` once the load ended.
    """

    slots: tuple[int, ...] = ()
    """Where the worker reads each block (the CPU pool's slots), one per block; empty to read
    by key."""
    payload: TransferPayload | None = None
    """The medium's own record of this load, for its handler; None for none."""


class MediumIndex(abc.ABC):
    """The scheduler half of a medium: what it holds, and each transfer's bookkeeping.

    Only `kvwire.media.MediumIndex.count_held_prefix` is required. A medium
    that decides where each block goes (the CPU pool's slots) overrides the `prepare_*` and
    `complete_*` calls; one whose entries are found by key alone keeps the defaults. The connector
    calls them in order: `prepare_load` once a lookup's blocks are allocated, `complete_load` once
    the load ended; `prepare_save` when it plans a save, `complete_save` with `success` once the
    worker reported the save made or not made.
    """

    concurrent_lookups: ClassVar[bool] = False
    """Whether `count_held_prefix` may run on a lookup thread while the scheduler's thread makes
    the index's other calls (the offload connector's `async_lookup` then runs it there).

    False (the default): every call is on the scheduler's thread.
    """

    @abc.abstractmethod
    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """How many of `block_hashes`, from the first, the medium holds for `group`.

        Only blocks a load can read now count. A sliding-window group's
        window is asked for last block first.
        """

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> LoadSpec:
        """Pin these blocks for a load; what the worker half gets with it (`LoadSpec`).

        Called only for blocks `kvwire.media.MediumIndex.count_held_prefix`
        just counted; a block gone meanwhile is an error the caller reports. The default
        pins nothing and gives nothing: the worker finds each block by key.
        """
        return LoadSpec()

    def complete_load(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        corrupt: Sequence[BlockHash],
        payload: TransferPayload | None = None,
    ) -> None:
        """The load of these blocks ended; `corrupt` ones failed verification.

        `payload` is the one `prepare_load` gave this load (`LoadSpec.payload`):
        it tells loads of the same blocks apart.
        """

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        """Which of these blocks to save, and where (a slot, or None to save by key).

        Blocks left out are not saved: the medium holds them already, or
        has no room (count those in `kvwire.media.MediumIndex.take_counters`). The
        default saves every one by key.
        """
        return [(block_hash, None) for block_hash in block_hashes]

    def complete_save(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        """The save of these blocks ended: made (publish them) or not (free their place)."""

    def take_step_payload(self) -> TransferPayload | None:
        """Work of the medium's own for its worker half, since the last call; None for none.

        Asked once per step, after every `prepare_*` call of it. The connector
        carries it with the step's plan to
        `kvwire.media.TransferHandler.begin_step`,
        which starts it before anything of the step moves blocks (a tiered
        medium's blocks evicted from its pool that no slower tier holds yet).
        None by default.
        """
        return None

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events this side saw since the last call (stored, removed blocks)."""
        return []

    def take_counters(self) -> Mapping[str, int]:
        """Counts since the last call, reported with the worker's stats (then reset)."""
        return {}

    def reset(self) -> bool | None:
        """Forget this engine's entries; True when done, False if some stayed, None if unknown."""
        return None

    def close(self) -> None:
        """Release connections and files; called once at shutdown."""


class TransferKind(enum.Enum):
    """Which way a `kvwire.media.TransferJob` moves blocks."""

    LOAD = "load"
    """From the medium into the KV cache."""
    SAVE = "save"
    """From the KV cache into the medium."""


@attrs.frozen
class TransferJob:
    """What the connector submits: blocks to move one way, under an id unique per handler."""

    job_id: int
    kind: TransferKind
    transfers: tuple[BlockTransfer, ...]


@attrs.frozen
class JobResult:
    """What the handler reports of a job that ended: by itself, or given up on at its deadline."""

    job_id: int
    failed: frozenset[int] = frozenset()
    """A load's block ids not loaded (the engine computes them again); empty for a save."""


class TransferHandler(abc.ABC):
    """The worker half of a medium: runs transfer jobs between the paged KV cache and the medium.

    The connector submits jobs (`kvwire.media.TransferHandler.submit`), learns which ended
    and which blocks of them failed (`kvwire.media.TransferHandler.poll`), and waits for the
    ones the forward pass needs (`kvwire.media.TransferHandler.wait`). Which request a job
    serves, which loads a step waits for and when a request's blocks are free again is the
    connector's bookkeeping, not the medium's.

    Jobs run off the forward pass. A load verifies every block before it
    counts as loaded: a block that fails is reported in
    `kvwire.media.JobResult.failed` (the engine computes it again), never
    loaded. A save reads the cache's blocks in place until it ends;
    `kvwire.media.TransferHandler.release_saves_reading` stops those
    reading blocks about to be written. Every job has a deadline, the medium's `transfer_timeout_s`
    from its submission: a job still running then is given up on, writes nothing more into the cache
    and ends with every block failed. Every wait has a deadline.
    """

    @abc.abstractmethod
    def submit(self, job: TransferJob) -> None:
        """Start `job` in the background; only submits (the forward pass never waits for I/O)."""

    @abc.abstractmethod
    def poll(self) -> list[JobResult]:
        """The jobs ended since the last call, each once; jobs past their deadline end first."""

    @abc.abstractmethod
    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        """Block until each of `job_ids` ended, or until `until` (`time.monotonic()`).

        Whether they all ended. A job past its deadline is given up on and
        counts as ended; so does an id this handler has already reported.
        Without `until` it still returns, by the last job's deadline. The
        jobs stay to be reported by `kvwire.media.TransferHandler.poll`.
        """

    @abc.abstractmethod
    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        """Stop the saves reading blocks of `request_ids` or any of `block_ids`.

        Called before a forward pass that may write those blocks. A stopped
        save commits nothing more. Returns the saves (or their pieces)
        stopped so, so the scheduler half never publishes them.
        """

    def begin_step(self, payload: TransferPayload) -> None:
        """Start the work the index's `take_step_payload` gave this step; only submits.

        Called before the step's loads and saves. A medium whose index
        gives none need not implement it.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.begin_step: this medium's index gave work for a step "
            "(take_step_payload), but its handler does not implement begin_step()"
        )

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events this side saw since the last call (media whose index sees none)."""
        return []

    def take_counters(self) -> Mapping[str, float]:
        """The medium's own counts since the last call, reported with the stats."""
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Let the jobs in flight end (each within its deadline), then release everything."""


class Medium(abc.ABC):
    """A place to keep blocks: its options, and a factory of its two halves.

    One object per connector instance, built in both roles from the same
    `kvwire.media.MediumContext`; a scheduler-role connector asks it for
    `kvwire.media.Medium.build_index` only, a worker-role one for
    `kvwire.media.Medium.build_handler` only. Subclasses name themselves in KV
    cache events (`kvwire.media.Medium.event_medium`) and declare their
    `kv_connector_extra_config` keys.
    """

    event_medium: ClassVar[str] = "medium"
    """The `medium` of the KV cache events this medium's blocks appear in (`cpu`, `disk`)."""
    found_by_key: ClassVar[bool] = True
    """Whether a block is found by its key alone, whoever wrote it: the index places nothing.

    False for a medium whose scheduler half decides where each block goes and
    publishes it (the CPU pool's slots, the peer medium's directory). Only a
    medium found by key can be a tiered medium's secondary tier: the tier's
    worker half writes it on its own.
    """

    def __init__(self, context: MediumContext) -> None:
        self.context = context

    @classmethod
    @abc.abstractmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        """The `kv_connector_extra_config` keys this medium accepts."""

    @classmethod
    def finish_options(cls, connector_name: str, options: dict[str, Any]) -> dict[str, Any]:
        """Check what the keys alone cannot, and derive values; `ExtraConfigError` if bad.

        Runs at `kvwire check` too: no side effects (no file, no
        connection). The default returns `options` as they are.
        """
        return options

    @classmethod
    def check_plugins(cls, plugins: Mapping[str, Any]) -> None:
        """Check the classes the plug-in options named (`MediumContext.plugins`).

        `ExtraConfigError` naming the option if one cannot serve; runs at
        `kvwire check` too. The default accepts them all.
        """

    @property
    def layout(self) -> BlockLayout:
        """The layout of one entry of any group, as this medium stores it."""
        return self.context.layout

    @property
    def group_layouts(self) -> tuple[BlockLayout, ...]:
        """Each KV cache group's entry layout (its name is in the fingerprint).

        With a single group, just the context's layout, so its entries keep
        their names.
        """
        layout, groups = self.layout, self.context.groups
        if len(groups) == 1:
            return (layout,)
        return tuple(attrs.evolve(layout, group=group.name) for group in groups)

    @abc.abstractmethod
    def build_index(self) -> MediumIndex:
        """The scheduler half; called once, by a scheduler-role connector."""

    @abc.abstractmethod
    def build_handler(
        self, kv_caches: Mapping[str, torch.Tensor], counters: Counters
    ) -> TransferHandler:
        """The worker half over the registered caches; built once, by a worker connector.

        `kv_caches` maps each layer's name to its paged KV cache tensor;
        `kvwire.media.Counters` collects the counts the connector
        reports as stats.
        """
