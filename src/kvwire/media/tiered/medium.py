"""The tiered medium: a CPU-memory pool (the primary tier) in front of slower media.

The primary tier is the CPU pool (`kvwire.media.cpu_pool`): its slot table,
eviction policy and admission of saves decide what this host keeps in
memory. Behind it, one or more secondary tiers, each a kvwire medium found
by key (`Medium.found_by_key`: shared storage, Redis or Redis Cluster, a
plug-in store, ...), reach the engine only through the pool:

- a lookup asks the pool, then each secondary tier in turn for the blocks
  after those the tier before it holds;
- a block found in a secondary tier is brought into a pool slot first
  (promotion: its next reuse is a memory copy), then copied into the cache;
  with `promotion: never`, it is read from its tier straight into the
  cache, as that tier alone would read it, and the pool holds only the
  blocks this engine saved: where the tier is as fast as memory (a disk
  whose entries are in the page cache), a promotion's read, its second
  copy and the spill of the block it evicts buy nothing;
- a secondary tier is written from the pool's memory, never by a second
  read of the engine's cache, as `write_policy` says: `write_through`
  writes each block once its pool save is made (the other engines sharing
  the tier see it at once: what a prefill engine that publishes wants);
  `spill` writes a block only when the pool evicts it and no secondary
  tier holds it yet, so blocks that stay hot in memory cost the tiers
  nothing. With `spill`, one entry in `SPILL_BUFFER_SHARE` of
  `cpu_pool_bytes` (at most `MAX_SPILL_BUFFERS`; none in a pool of fewer
  than `SPILL_BUFFER_SHARE` entries) is a spill buffer, not a slot of the
  pool: a block evicted to make room for a promotion is copied into one,
  and written to the tiers from there, so that the promotion reads its
  block into the slot at once instead of waiting for that write;
- with `write_around: true`, a block of a save that the pool does not take
  (its admission refused it: `save_threshold`; or every slot was pinned)
  is written to the tiers straight from the cache, as a tier alone would:
  with a `save_threshold` above 1, the pool holds the blocks seen again and
  every other block costs one write, where without it such a block reaches
  no tier at all;
- a secondary tier that cannot keep up drops writes (its
  `max_save_bytes_in_flight`, counted as `tier<N>.saves_dropped`); a pool
  slot whose block is still being written waits for it before it is reused,
  on the pool's copy threads, never on the forward pass.

`kv_connector_extra_config` keys: the CPU pool's (`cpu_pool_bytes`,
`io_threads`, `transfer_timeout_s`, `eviction`, `save_threshold`; see
`kvwire.media.cpu_pool.medium`), and

- `write_policy` (default `"write_through"`): `write_through` or `spill`;
- `promotion` (default `"always"`): `always` brings each block found in a
  secondary tier into the pool; `never` reads it straight into the cache,
  through a second handler of that tier built over the engine's cache, whose
  `transfer_timeout_s` is at most half the pool's (`DIRECT_TIMEOUT_SHARE`)
  so that it gives up on a read before the load that waits for it does;
- `write_around` (default false): write the blocks the pool does not take
  to the tiers from the cache (through that same second handler);
- `tiers` (required): a list of secondary tiers, first looked up first,
  each a mapping of `medium` (a registered medium's name other than
  `tiered`, found by key: not `cpu_pool` nor `peer`) and that medium's own keys:

```yaml
kv_connector: TieredOffloadConnector
kv_connector_extra_config:
  cpu_pool_bytes: 1GiB
  eviction: arc
  write_policy: spill
  tiers:
    - medium: redis
      url: redis://127.0.0.1:6379/0
```

Counts: the pool's own under their names (`blocks_saved`, `evicted_blocks`,
...), each secondary tier's under `tier<N>.` (`tier1.bytes_saved`); the
scheduler half adds per tier `tier<N>.lookup_hit_blocks`, the blocks it
brought in (`tier<N>.promoted_blocks`) or had read straight into the cache
(`tier<N>.direct_blocks`); the worker half the blocks it asked each tier to
write (`tier<N>.spilled_blocks`, `tier<N>.written_through_blocks`,
`tier<N>.written_around_blocks`) and the writes given up on because their
slot was needed (`tier<N>.writes_released`), the blocks evicted for a
promotion that found no spill buffer free (`spills_without_buffer`: their
promotions waited for those writes), and the direct reads not started for
lack of time (`direct_reads_too_late`); and the lookup delay:
`tier<N>.lookup_microseconds` over `tier<N>.lookups`, and how many took at
most 1, 10 and 100 ms (`tier<N>.lookups_le_1ms`, ...): the lookup delay's
histogram.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvwire.common.redaction import shown
from kvwire.config.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    ResolvedMedium,
    bool_key,
)
from kvwire.media.base import Medium, MediumContext, MediumIndex, TransferHandler
from kvwire.media.cpu_pool.medium import CPUPoolMedium, eviction_policy, save_admission
from kvwire.media.tiered.index import TieredIndex

if TYPE_CHECKING:
    import torch

__all__ = [
    "DIRECT_TIMEOUT_SHARE",
    "MAX_SPILL_BUFFERS",
    "PROMOTIONS",
    "SPILL_BUFFER_SHARE",
    "WRITE_POLICIES",
    "TieredMedium",
]

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "spill")
"""How blocks reach the secondary tiers (see the module)."""
PROMOTIONS = ("always", "never")
"""Whether a block found in a secondary tier is brought into the pool (see the module)."""
DIRECT_TIMEOUT_SHARE = 0.5
"""A tier's reads straight into the cache get at most this share of the pool's
`transfer_timeout_s`: none starts unless it would be given up on before its load is."""
SPILL_BUFFER_SHARE = 16
"""With `spill`, one entry of the pool's memory in this many is a spill buffer."""
MAX_SPILL_BUFFERS = 64
"""The most spill buffers a pool keeps; a step's promotions beyond them wait for their writes."""


class TieredMedium(CPUPoolMedium):
    """The CPU pool, with secondary tiers behind it, each a medium of its own."""

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        self.check_plugins(context.plugins)
        resolved: tuple[object, ...] = tuple(context.plugins.get("tiers") or ())
        if not resolved:
            raise ValueError(
                f"{context.connector_name}: MediumContext.plugins has no 'tiers' (each secondary "
                "tier's medium, resolved); build the medium through kvwire's container, or pass "
                "plugins=kvwire.config.extra_config.plugin_classes(keys, options, registry)"
            )
        self._resolved_tiers = resolved
        self.tiers: tuple[Medium, ...] = tuple(
            _tier_medium(context, number, tier) for number, tier in enumerate(resolved, 1)
        )
        """The secondary tiers' media, first looked up first."""
        if self.reaches_cache:
            _check_direct_reads(resolved)
        self.spill_buffers = 0 if self.write_through else spill_buffer_count(self.num_slots)
        """The entries of `cpu_pool_bytes` kept as spill buffers, out of the pool's slots."""
        self.num_slots -= self.spill_buffers

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        """The `kv_connector_extra_config` keys: see the module docstring."""
        return (
            *super().extra_config_keys(),
            ExtraConfigKey(
                "write_policy",
                "write_through",
                lambda value: value if value in WRITE_POLICIES else None,
                " or ".join(repr(policy) for policy in WRITE_POLICIES),
            ),
            bool_key("write_around", False),
            ExtraConfigKey(
                "promotion",
                "always",
                lambda value: value if value in PROMOTIONS else None,
                " or ".join(repr(promotion) for promotion in PROMOTIONS),
            ),
            ExtraConfigKey(
                "tiers",
                None,
                _tier_list,
                "a non-empty list of mappings, each with 'medium' (a medium's name other than "
                "'tiered') and that medium's own keys",
                plugin="media",
            ),
        )

    @classmethod
    def finish_options(cls, connector_name: str, options: dict[str, Any]) -> dict[str, Any]:
        if options["tiers"] is None:
            raise ExtraConfigError(
                f"kv_connector_extra_config.tiers is required by {connector_name}: a list of "
                "secondary tiers, each a mapping with 'medium' and that medium's keys"
            )
        return options

    @property
    def reaches_cache(self) -> bool:
        """Whether the tiers move blocks to and from the cache directly (else only the pool)."""
        return not self.promotes or bool(self.context.options["write_around"])

    @property
    def promotes(self) -> bool:
        """Whether a block found in a secondary tier is brought into the pool (else read direct)."""
        return bool(self.context.options["promotion"] == "always")

    @classmethod
    def check_plugins(cls, plugins: Mapping[str, Any]) -> None:
        """Every tier is found by key; none is a CPU pool (the primary tier is one already)."""
        problems = []
        for position, tier in enumerate(plugins.get("tiers") or ()):
            if not (isinstance(tier, ResolvedMedium) and isinstance(tier.medium_class, type)):
                continue
            if issubclass(tier.medium_class, CPUPoolMedium):
                problems.append(
                    f"kv_connector_extra_config.tiers[{position}].medium: {tier.name!r} is a "
                    "CPU pool, as the primary tier is: a second one behind it only copies blocks "
                    "twice; expected a slower medium, such as directory or redis (give the pool "
                    "more memory with cpu_pool_bytes)"
                )
            elif issubclass(tier.medium_class, Medium) and not tier.medium_class.found_by_key:
                problems.append(
                    f"kv_connector_extra_config.tiers[{position}].medium: {tier.name!r} places "
                    "its blocks itself (found_by_key is False), so it cannot be a secondary "
                    "tier; expected a medium found by key, such as directory or redis (for a "
                    "pool every engine reads, use the peer medium as an OffloadConnector's own)"
                )
        if problems:
            raise ExtraConfigError("\n".join(problems))

    @property
    def write_through(self) -> bool:
        """Whether each block is written to the secondary tiers once saved (else on eviction)."""
        return bool(self.context.options["write_policy"] == "write_through")

    def build_index(self) -> MediumIndex:
        options = self.context.options
        return TieredIndex(
            self.num_slots,
            len(self.context.groups),
            self.event_medium,
            tiers=[tier.build_index() for tier in self.tiers],
            write_through=self.write_through,
            policy=eviction_policy(self.context, self.num_slots),
            admission=save_admission(options["save_threshold"], self.num_slots),
            spill_buffers=self.spill_buffers,
            promotes=self.promotes,
            write_around=bool(options["write_around"]),
        )

    def pool_handler(
        self, kv_caches: Mapping[str, torch.Tensor], **arguments: Any
    ) -> TransferHandler:
        # Imported here: it needs torch, which the scheduler half never imports.
        from kvwire.media.tiered.handler import TieredTransferHandler

        if self.spill_buffers:
            logger.info(
                "%s: and %d entries of cpu_pool_bytes are spill buffers",
                self.context.connector_name,
                self.spill_buffers,
            )
        return TieredTransferHandler(
            **arguments,
            tiers=self.tiers,
            groups=self.context.groups,
            write_through=self.write_through,
            spill_buffers=self.spill_buffers,
            direct=(self._direct_media(), kv_caches) if self.reaches_cache else None,
        )

    def _direct_media(self) -> tuple[Medium, ...]:
        """Each tier's medium again, for reads straight into the cache (`promotion: never`).

        Its `transfer_timeout_s` is at most `DIRECT_TIMEOUT_SHARE` of the
        pool's: the pool's load gives up on a block at its own deadline, so a
        read into the engine's cache must have been given up on before then.
        """
        timeout_s = DIRECT_TIMEOUT_SHARE * self.context.options["transfer_timeout_s"]
        media = []
        for number, tier in enumerate(self._resolved_tiers, 1):
            assert isinstance(tier, ResolvedMedium)  # as __init__ checked
            own = tier.options["transfer_timeout_s"]
            options = {**tier.options, "transfer_timeout_s": min(own, timeout_s)}
            media.append(_tier_medium(self.context, number, attrs.evolve(tier, options=options)))
        return tuple(media)


def _check_direct_reads(tiers: tuple[object, ...]) -> None:
    """Every tier has a `transfer_timeout_s` that the reads into the cache can shorten."""
    for position, tier in enumerate(tiers):
        if isinstance(tier, ResolvedMedium) and "transfer_timeout_s" not in tier.options:
            raise ExtraConfigError(
                f"kv_connector_extra_config.tiers[{position}].medium: {tier.name!r} has no "
                "transfer_timeout_s, which promotion: never and write_around need, to give up "
                "on a transfer with the cache before the pool's job does; expected a store "
                "medium (directory, redis, ...), or promotion: always without write_around"
            )


def spill_buffer_count(entries: int) -> int:
    """How many of a spilling pool's `entries` are spill buffers (see the module)."""
    return min(entries // SPILL_BUFFER_SHARE, MAX_SPILL_BUFFERS)


def _tier_list(value: Any) -> tuple[dict[str, Any], ...] | None:
    """`value` as a tuple of tier mappings, each naming its medium; None if it is not one."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    tiers = []
    for item in value:
        if not isinstance(item, Mapping) or not isinstance(item.get("medium"), str):
            return None
        if item["medium"].lower() == "tiered":
            return None
        tiers.append(dict(item))
    return tuple(tiers)


def _tier_medium(context: MediumContext, number: int, tier: Any) -> Medium:
    """Secondary tier `number`'s medium, built from its resolved class and options."""
    if not isinstance(tier, ResolvedMedium):
        raise TypeError(
            f"{context.connector_name}: tiers[{number - 1}] resolved to {shown(tier)}, expected "
            "a kvwire.config.extra_config.ResolvedMedium"
        )
    tier_context = attrs.evolve(
        context,
        connector_name=f"{context.connector_name} tier {number} ({tier.name})",
        options=tier.options,
        plugins=tier.plugins,
    )
    medium: Medium = tier.medium_class(tier_context)
    return medium
