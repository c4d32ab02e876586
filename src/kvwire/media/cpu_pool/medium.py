"""The CPU pool medium: preallocated slots in this host's memory.

The scheduler half's index (`kvwire.media.cpu_pool._slot_table`) decides
which slot holds which block, evicting as its eviction policy says; the worker
side (`kvwire.media.cpu_pool.handler`) owns the pool memory and copies.
A slot holds one block of every layer of one KV cache group plus a 128-byte
header; every group's entries have the same size, so the groups share the
pool. A block becomes a hit only once its save is complete. Entries carry
no payload checksum (see `kvwire.blocks.format`): their headers name
their block and layout, and nothing but kvwire writes this memory.

`kv_connector_extra_config` keys:

- `cpu_pool_bytes` (default `"256MiB"`): pool size, at least one entry;
- `io_threads` (default 2): copy threads per direction;
- `transfer_timeout_s` (default 30): the deadline of each copy; a load
  still running then is a load error (computed again), a save still
  running then counts failed;
- `eviction` (default `"kvfifo"`): the eviction policy, a name registered
  in `registry.eviction_policies` (`kvfifo`, S3-FIFO adapting its queues
  and told which blocks continue an earlier prompt, the best or within
  0.003 of the best at every pool size of every shape of traffic the tiers
  benchmark replays; `lru`, least recently used; `s3fifo`, S3-FIFO, and
  `arc`, ARC, which both keep blocks reused often when one-off prompts
  pass; see `kvwire.media.eviction`) or a policy class as
  `package.module:Class`. The container resolves it through its registry
  and hands the class in (`MediumContext.plugins["eviction"]`);
- `save_threshold` (default 1): a block is saved only once it was offered
  for a save this many times (`kvwire.media.admission`); 1 saves every
  block.

Counts reported with the stats: `evicted_blocks` (blocks the pool dropped
to make room), `stores_skipped_pool_full` (blocks not stored because
every slot was in use by a transfer) and `saves_not_admitted` (blocks not
saved because they were not seen `save_threshold` times yet).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from kvwire.blocks.format import HEADER_SIZE
from kvwire.config.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    int_key,
    memory_size_key,
    seconds_key,
)
from kvwire.interface.counters import Counters
from kvwire.media.admission import SaveAdmission
from kvwire.media.base import Medium, MediumContext, MediumIndex, TransferHandler
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.eviction import EvictionPolicy, KVFIFOPolicy

if TYPE_CHECKING:
    import torch

__all__ = ["CPUPoolMedium"]

logger = logging.getLogger(__name__)

DEFAULT_EVICTION = "kvfifo"
"""The `eviction` option's default: the policy the tiers benchmark found best on every shape."""


class CPUPoolMedium(Medium):
    """Blocks kept in a preallocated CPU memory pool of `num_slots` entries."""

    event_medium: ClassVar[str] = "cpu"
    found_by_key: ClassVar[bool] = False

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        pool_bytes = context.options["cpu_pool_bytes"]
        entry_bytes = _largest_entry_bytes(context)
        self.num_slots: int = pool_bytes // entry_bytes
        """How many entries the pool holds (one block of one KV cache group each)."""
        if self.num_slots < 1:
            raise ExtraConfigError(
                f"kv_connector_extra_config.cpu_pool_bytes: {pool_bytes} bytes hold no block; "
                f"expected at least {entry_bytes} (one block of every layer plus its header)"
            )

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        """The `kv_connector_extra_config` keys: see the module docstring."""
        return (
            memory_size_key("cpu_pool_bytes", 256 * 1024**2),
            int_key("io_threads", 2, minimum=1, maximum=64),
            seconds_key("transfer_timeout_s", 30.0, maximum=24 * 3600),
            ExtraConfigKey(
                "eviction",
                DEFAULT_EVICTION,
                _eviction_policy_name,
                "an eviction policy's name (lru, s3fifo, arc, kvfifo, or another that kvwire "
                "connectors lists) or 'package.module:Class'",
                plugin="eviction_policies",
            ),
            int_key("save_threshold", 1, minimum=1, maximum=_MAX_SAVE_THRESHOLD),
        )

    def build_index(self) -> MediumIndex:
        options = self.context.options
        return CPUPoolIndex(
            self.num_slots,
            len(self.context.groups),
            self.event_medium,
            policy=eviction_policy(self.context, self.num_slots),
            admission=save_admission(options["save_threshold"], self.num_slots),
        )

    def build_handler(
        self, kv_caches: Mapping[str, torch.Tensor], counters: Counters
    ) -> TransferHandler:
        # Imported here: they need torch, which the scheduler half never imports.
        from kvwire.blocks.paged_cache import group_caches

        context = self.context
        handler = self.pool_handler(
            kv_caches,
            # Memory this process allocated and only kvwire writes: the
            # headers name each slot's block, a payload checksum would buy nothing.
            layouts=tuple(
                attrs.evolve(layout, payload_checksum=False) for layout in self.group_layouts
            ),
            caches=group_caches(kv_caches, context.layout, context.groups),
            num_slots=self.num_slots,
            io_threads=context.options["io_threads"],
            counters=counters,
            transfer_timeout_s=context.options["transfer_timeout_s"],
        )
        logger.info(
            "%s: a pool of %d blocks of %d bytes (%.1f MiB), %d KV cache groups",
            context.connector_name,
            self.num_slots,
            context.layout.payload_bytes,
            self.num_slots * context.layout.entry_bytes / 2**20,
            len(context.groups),
        )
        return handler

    def pool_handler(
        self, kv_caches: Mapping[str, torch.Tensor], **arguments: Any
    ) -> TransferHandler:
        """The worker half over the pool, from `build_handler`'s checked arguments.

        A medium built on the pool (the tiered medium) returns its own handler
        here, one holding a pool handler built from these arguments;
        `kv_caches` are the engine's caches as `build_handler` was given them,
        which the pool's own handler takes grouped (`caches`).
        """
        from kvwire.media.cpu_pool.handler import CPUPoolTransferHandler

        del kv_caches  # the pool's handler reads them through `caches`
        return CPUPoolTransferHandler(**arguments)


# A count-min sketch's one-byte counters are halved as they age: a threshold
# far above the handful of sightings a hot prefix gathers would admit nothing.
_MAX_SAVE_THRESHOLD = 64


def _eviction_policy_name(value: Any) -> str | None:
    """`value` when it can name an eviction policy: the registry checks the name itself."""
    return value if isinstance(value, str) and value else None


def eviction_policy(context: MediumContext, num_slots: int) -> EvictionPolicy:
    """The pool's eviction policy over `num_slots` slots: the class the `eviction` option names.

    The class comes resolved in `context.plugins` (the container's registry
    resolved it). A context built by hand may leave it out for the default,
    `kvfifo`, which needs no registry; for any other name it is told how to
    pass the class.
    """
    policy_class = context.plugins.get("eviction")
    if policy_class is None and context.options.get("eviction", DEFAULT_EVICTION) == (
        DEFAULT_EVICTION
    ):
        policy_class = KVFIFOPolicy
    if policy_class is None:
        raise ValueError(
            f"{context.connector_name}: MediumContext.plugins has no 'eviction' class (the "
            "policy the eviction option names); build the medium through kvwire's container, "
            "or pass "
            "plugins=kvwire.config.extra_config.plugin_classes(keys, options, registry)"
        )
    policy: EvictionPolicy = policy_class(num_slots)
    return policy


def save_admission(threshold: int, num_slots: int) -> SaveAdmission | None:
    """The admission of saves; None for a threshold of 1 (every block saved, nothing counted).

    The sketch has eight counters per slot and row (a power of two, 1024 to
    2**22: 4 KiB to 16 MiB), so it counts eight pools' worth of sightings
    before its counts halve: a block offered again within that is admitted.
    """
    if threshold == 1:
        return None
    width = 1 << max(10, min(22, (8 * num_slots - 1).bit_length()))
    return SaveAdmission(threshold, width)


def _largest_entry_bytes(context: MediumContext) -> int:
    """The bytes of the largest rank's entry: every rank's pool has as many slots.

    The scheduler half gives one slot to a block on every rank; pipeline
    stages may hold unequal numbers of layers, so the slots are counted for
    the stage with the most.
    """
    layout, stages = context.layout, context.parallel.pipeline_layers
    if not stages:
        return layout.entry_bytes
    most = max(stop - start for start, stop in itertools.pairwise(stages))
    return HEADER_SIZE + layout.payload_bytes // layout.num_layers * most
