"""How well the CPU pool decides what to keep, against the best any cache of its size could do.

``python -m benchmarks.tiers [--quick]``: traces shaped like serving traffic
are generated (seeded, so every run sees the same ones; `kvwire.replay.synthetic`),
one per named shape: `mixed` (Zipf-popular system prompts and documents
shared by many requests, multi-turn sessions whose prompt grows by a few
blocks each turn, and one-off prompts mixed in, whose blocks are never asked
for again), `conversation` (production chat: long system prompts, most
blocks used once), `agent` (long tool loops) and `rag` (documents). Each is
replayed at pools of 1%, 2%, 5% and 10% of its distinct blocks, and `mixed`
also at 512, 1,024 and 2,048 blocks. Each request's block hashes go through the CPU pool's own
index (`CPUPoolIndex` over `SlotTable`, built with the policy and admission
its ``eviction`` and ``save_threshold`` options name) as the offload
connector drives it: a lookup of the held prefix, a load of it, a save of the
rest (`kvwire.replay.pool`, what ``kvwire replay`` runs on a user's trace).

Beside each configuration's hit rate (blocks loaded from the pool over
blocks asked for), the hit rate of Belady's offline optimum on the same
block accesses and pool size: on a miss it keeps the block whose next use is
soonest, evicting the block used again farthest in the future, or not
saving the new block when that block is the new one itself (an optimum that
may refuse saves, as admission does). It counts every held block as a hit,
the pool only a held prefix, so it bounds every policy from above
(`kvwire.replay.belady`). Each hit rate is reported as a ratio of it,
with the microseconds each configuration took per block asked for (the
index and its policy on the scheduler thread: noisy, compare within a run).
Two references show what the gap to the optimum is made of: the best fixed
content in hindsight (`fixed_best_hits`: a pool that knew how often each
block is asked for, but not when), and `lru` and `kvfifo` with an admission
that knows which blocks are asked for again (`saves_asked_again`: no save is
wasted, so what is left is the order of the future uses, which only the
optimum knows).

Then the `mixed` trace through the tiered medium's index (`TieredIndex`), a
pool of each size in front of a disk that holds every block written to it:
hits of each tier, blocks computed (a miss of both), blocks written to
the disk and blocks copied into the pool (saved there or promoted: on a
disk as fast as memory, the tiered connector's cost over the disk alone),
for each write policy (`write_through`, `spill`) and eviction policy, with
`promotion: never` and with `write_around`; beside it, a `MultiConnector`
of a CPU pool and a disk, the composition the tiered connector replaces
(the first child with a hit loads, every computed block is saved to both,
nothing loaded from the disk enters the pool). Written to
``tiers.json`` and ``tiers.md``; ``run`` returns the ratios, for
``summary.json``.
"""

from __future__ import annotations

import collections
import itertools
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from benchmarks.common import main as run_main
from benchmarks.common import write_json
from kvwire.interface.types import BlockHash
from kvwire.media.base import MediumIndex
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.cpu_pool.medium import save_admission
from kvwire.media.tiered.index import Place, Spills, TieredIndex, TieredLoad
from kvwire.registry import default_registry
from kvwire.replay.belady import belady_hits as belady_hits
from kvwire.replay.pool import SaveChoice, replay_pool
from kvwire.replay.sweep import POLICIES as POLICIES
from kvwire.replay.sweep import SAVE_THRESHOLDS as THRESHOLDS
from kvwire.replay.synthetic import SHAPES
from kvwire.replay.synthetic import Trace as Trace
from kvwire.replay.synthetic import TraceShape as SyntheticShape
from kvwire.replay.synthetic import generate_trace as generate_trace


@attrs.frozen
class TraceShape(SyntheticShape):
    """The generated traffic, and the pool sizes measured on it (each on the same trace)."""

    capacities: tuple[int, ...] = attrs.field(kw_only=True)


FULL = TraceShape(requests=6000, capacities=(512, 1024, 2048))
QUICK = TraceShape(requests=1200, capacities=(256,))

FRACTIONS = (0.01, 0.02, 0.05, 0.1)
"""Pool sizes measured on every shape: fractions of the trace's distinct blocks."""
QUICK_FRACTIONS = (0.05,)
QUICK_REQUESTS = 300
"""Requests of each shape's trace in a quick run."""
KNOWING_REUSE = ("lru", "kvfifo")
"""The policies replayed with `saves_asked_again` on every shape: what knowing the
future's reuse would buy them."""


def simulate(
    trace: Trace,
    capacity: int,
    eviction: str,
    save_threshold: int,
    choose_saves: SaveChoice | None = None,
) -> dict[str, Any]:
    """The trace through the CPU pool's index as the offload connector drives it."""
    replay = replay_pool(trace, capacity, eviction, save_threshold, choose_saves=choose_saves)
    return {
        "eviction": eviction,
        "save_threshold": save_threshold,
        "hit_rate": replay.hit_rate,
        "hit_blocks": replay.hit_blocks,
        "saved_blocks": replay.saved_blocks,
        "evicted_blocks": replay.evicted_blocks,
        "saves_not_admitted": replay.saves_not_admitted,
        "microseconds_per_block": replay.seconds / replay.asked_blocks * 1e6,
    }


def saves_asked_again(trace: Trace) -> SaveChoice:
    """An admission no pool can have: it saves a request's missed blocks up to the first
    that no later request asks for (every block after it is asked for no more either:
    a block names its whole prefix)."""
    last_use: dict[BlockHash, int] = {}
    for position, hashes in enumerate(trace):
        for block in hashes:
            last_use[block] = position

    def choose(position: int, missed: Sequence[BlockHash]) -> Sequence[BlockHash]:
        for count, block in enumerate(missed):
            if last_use[block] == position:
                return missed[:count]
        return missed

    return choose


def fixed_best_hits(accesses: Sequence[BlockHash], capacity: int) -> int:
    """The hits of the best fixed content in hindsight: the `capacity` blocks asked for most.

    Each misses its first use only. A block is asked for at most as often as
    its prefix (every prompt that holds it holds the prefix), so these blocks
    can always be chosen prefix by prefix and every one of their later uses
    is a hit of a held prefix: what a pool that knew the trace's counts, but
    not their order, would keep.
    """
    uses = sorted(collections.Counter(accesses).values(), reverse=True)[:capacity]
    return sum(uses) - len(uses)


class _SetTier(MediumIndex):
    """A secondary tier large enough for the whole trace: the blocks written to it."""

    def __init__(self) -> None:
        self.held: set[BlockHash] = set()

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.held:
                break
            count += 1
        return count


def simulate_tiered(
    trace: Trace,
    capacity: int,
    eviction: str,
    save_threshold: int,
    write_policy: str,
    *,
    write_around: bool = False,
    promotion: str = "always",
) -> dict[str, Any]:
    """The trace through the tiered medium's index: a pool of `capacity` in front of a disk.

    Hits are counted per tier; a block brought in from the disk is kept in
    the pool (promotion), unless `promotion` is ``never``. The disk is
    written what `write_policy` says: every block saved in the pool
    (`write_through`), or each block the pool evicts that the disk lacks
    (`spill`); with `write_around`, also each block the pool does not take.
    Pool copies are the blocks copied into the pool: saved there, or brought
    in from the disk.
    """
    disk = _SetTier()
    index = TieredIndex(
        capacity,
        1,
        "cpu",
        tiers=[disk],
        write_through=write_policy == "write_through",
        policy=default_registry().eviction_policies.get_class(eviction)(capacity),
        admission=save_admission(save_threshold, capacity),
        promotes=promotion == "always",
        write_around=write_around,
    )
    asked = pool_hits = disk_hits = written = pool_copies = 0
    for hashes in trace:
        asked += len(hashes)
        held = index.count_held_prefix(0, hashes)
        if held:
            payload = index.prepare_load(0, hashes[:held]).payload
            assert isinstance(payload, TieredLoad)
            from_disk = sum(1 for place in payload.places if place in (Place.TIER, Place.DIRECT))
            pool_copies += sum(1 for place in payload.places if place is Place.TIER)
            missing = [
                h
                for h, place in zip(hashes[:held], payload.places, strict=True)
                if place is Place.MISSING
            ]
            index.complete_load(0, hashes[:held], missing, payload=payload)
            disk_hits += from_disk
            pool_hits += held - from_disk - len(missing)
            held -= len(missing)
        places = index.prepare_save(0, hashes[held:])
        if places:
            # A block the pool does not take has the slot past its memory: written around it.
            around = [block for block, slot in places if slot is not None and slot >= capacity]
            placed = [block for block, _ in places]
            index.complete_save(0, placed, success=True)
            pool_copies += len(placed) - len(around)
            written += len(around)
            disk.held.update(around)
            if write_policy == "write_through":
                in_pool = set(placed).difference(around)
                written += len(in_pool)
                disk.held.update(in_pool)
        spills = index.take_step_payload()
        for spilled in spills.groups if isinstance(spills, Spills) else ():
            written += len(spilled.block_hashes)
            disk.held.update(spilled.block_hashes)
        index.take_events()
        index.take_counters()
    name = f"tiered {eviction} {write_policy}"
    if write_around:
        name += " write_around"
    if promotion != "always":
        name += f" promotion {promotion}"
    return _tier_row(name, save_threshold, asked, pool_hits, disk_hits, written, pool_copies)


def simulate_multi_connector(trace: Trace, capacity: int) -> dict[str, Any]:
    """The trace through a `MultiConnector` of a CPU pool (LRU) and a disk, as the profile was.

    The first child with a hit loads: the pool's prefix, else the disk's;
    every block computed is saved to both (the disk writes the ones it lacks);
    nothing loaded from the disk enters the pool.
    """
    pool = CPUPoolIndex(capacity, 1, "cpu")
    disk: set[BlockHash] = set()
    asked = pool_hits = disk_hits = written = pool_copies = 0
    for hashes in trace:
        asked += len(hashes)
        held = pool.count_held_prefix(0, hashes)
        if held:
            pool.prepare_load(0, hashes[:held])
            pool.complete_load(0, hashes[:held], ())
            pool_hits += held
        else:
            while held < len(hashes) and hashes[held] in disk:
                held += 1
            disk_hits += held
        computed = hashes[held:]
        placed = [block for block, _ in pool.prepare_save(0, computed)]
        if placed:
            pool.complete_save(0, placed, success=True)
        pool_copies += len(placed)
        new = [block for block in computed if block not in disk]
        written += len(new)
        disk.update(new)
        pool.take_events()
        pool.take_counters()
    return _tier_row(
        "MultiConnector lru write-through", 1, asked, pool_hits, disk_hits, written, pool_copies
    )


def _tier_row(
    name: str,
    save_threshold: int,
    asked: int,
    pool_hits: int,
    disk_hits: int,
    written: int,
    pool_copies: int,
) -> dict[str, Any]:
    return {
        "configuration": name,
        "save_threshold": save_threshold,
        "pool_hit_rate": pool_hits / asked,
        "disk_hit_rate": disk_hits / asked,
        "computed_blocks": asked - pool_hits - disk_hits,
        "disk_blocks_written": written,
        "pool_blocks_copied": pool_copies,
    }


TIERED: tuple[tuple[str, int, str, dict[str, Any]], ...] = (
    ("lru", 1, "write_through", {}),
    ("lru", 1, "spill", {}),
    ("arc", 1, "write_through", {}),
    ("arc", 1, "spill", {}),
    ("s3fifo", 1, "spill", {}),
    ("kvfifo", 1, "spill", {}),
    ("kvfifo", 1, "spill", {"promotion": "never"}),
    ("arc", 2, "spill", {}),
    ("kvfifo", 2, "spill", {"write_around": True}),
)
"""The tiered configurations measured: (eviction, save_threshold, write_policy, options)."""


def measure_shapes(quick: bool) -> list[dict[str, Any]]:
    """Every configuration on every named shape at `FRACTIONS` of its distinct blocks."""
    fractions = QUICK_FRACTIONS if quick else FRACTIONS
    measured = []
    for name, named in SHAPES.items():
        shape = attrs.evolve(named, requests=QUICK_REQUESTS) if quick else named
        trace = generate_trace(shape)
        accesses = [block for hashes in trace for block in hashes]
        distinct = len(set(accesses))
        choose_saves = saves_asked_again(trace)
        sizes = []
        for fraction in fractions:
            capacity = max(1, round(fraction * distinct))
            optimum = belady_hits(accesses, capacity) / len(accesses)
            rows = []
            for eviction, threshold in itertools.product(POLICIES, THRESHOLDS):
                row = simulate(trace, capacity, eviction, threshold)
                row["of_belady"] = row["hit_rate"] / optimum if optimum else None
                rows.append(row)
            references = {
                "fixed_best": fixed_best_hits(accesses, capacity) / len(accesses),
                **{
                    f"{eviction}_knowing_reuse": simulate(
                        trace, capacity, eviction, 1, choose_saves
                    )["hit_rate"]
                    for eviction in KNOWING_REUSE
                },
            }
            sizes.append(
                {
                    "fraction": fraction,
                    "capacity_blocks": capacity,
                    "belady_hit_rate": optimum,
                    "configurations": rows,
                    "references": {
                        name: {
                            "hit_rate": hit_rate,
                            "of_belady": hit_rate / optimum if optimum else None,
                        }
                        for name, hit_rate in references.items()
                    },
                }
            )
        measured.append(
            {
                "shape": name,
                "requests": shape.requests,
                "block_accesses": len(accesses),
                "distinct_blocks": distinct,
                "sizes": sizes,
            }
        )
    return measured


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    shapes = measure_shapes(quick)
    shape = QUICK if quick else FULL
    trace = generate_trace(shape)
    accesses = [block for hashes in trace for block in hashes]
    pools = []
    for capacity in shape.capacities:
        optimum = belady_hits(accesses, capacity) / len(accesses)
        rows = []
        for eviction, threshold in itertools.product(POLICIES, THRESHOLDS):
            row = simulate(trace, capacity, eviction, threshold)
            row["of_belady"] = row["hit_rate"] / optimum
            rows.append(row)
        tiered = [simulate_multi_connector(trace, capacity)]
        tiered += [
            simulate_tiered(trace, capacity, eviction, threshold, write_policy, **options)
            for eviction, threshold, write_policy, options in TIERED
        ]
        for row in tiered:
            row["pool_of_belady"] = row["pool_hit_rate"] / optimum
        pools.append(
            {
                "capacity_blocks": capacity,
                "belady_hit_rate": optimum,
                "configurations": rows,
                "tiered": tiered,
            }
        )
    result = {
        "requests": shape.requests,
        "block_accesses": len(accesses),
        "distinct_blocks": len(set(accesses)),
        "reused_accesses": len(accesses) - len(set(accesses)),
        "pools": pools,
        "shapes": shapes,
    }
    write_json(output_dir, "tiers.json", result)
    (output_dir / "tiers.md").write_text(_table(result))
    return summary(result)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline: per pool size, Belady's hit rate and each configuration's share of it.

    Then, per tiered configuration, its blocks computed and written to the
    disk as ratios of the MultiConnector's; then per shape and fraction of
    its distinct blocks, each configuration's share of Belady's.
    """
    headline: dict[str, Any] = {
        f"{shape['shape']} {size['fraction']:g}": {
            f"{row['eviction']}_threshold_{row['save_threshold']}": (
                None if row["of_belady"] is None else round(row["of_belady"], 3)
            )
            for row in size["configurations"]
        }
        for shape in result.get("shapes", ())
        for size in shape["sizes"]
    }
    for pool in result["pools"]:
        multi = pool["tiered"][0]
        headline[str(pool["capacity_blocks"])] = {
            "belady_hit_rate": round(pool["belady_hit_rate"], 3),
            **{
                f"{row['eviction']}_threshold_{row['save_threshold']}": round(row["of_belady"], 3)
                for row in pool["configurations"]
            },
            **{
                f"{row['configuration']} threshold {row['save_threshold']}": {
                    "computed_of_multi_connector": round(
                        row["computed_blocks"] / multi["computed_blocks"], 3
                    ),
                    "written_of_multi_connector": round(
                        row["disk_blocks_written"] / multi["disk_blocks_written"], 3
                    ),
                }
                for row in pool["tiered"][1:]
            },
        }
    return headline


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _shapes_table(shapes: list[dict[str, Any]]) -> list[str]:
    """Per shape and pool size, each configuration's share of Belady's; then µs per block."""
    configurations = [f"{policy} {threshold}" for policy in POLICIES for threshold in THRESHOLDS]
    lines = [
        "Each configuration's hit rate as a share of Belady's, per trace shape and pool size "
        "(a fraction of the trace's distinct blocks); column `eviction save_threshold`; the "
        "highest of each row in bold.",
        "",
        "| shape | pool (blocks) | Belady | " + " | ".join(configurations) + " |",
        "|---|---|---|" + "---|" * len(configurations),
    ]
    for shape in shapes:
        for size in shape["sizes"]:
            ratios = [row["of_belady"] for row in size["configurations"]]
            best = max((ratio for ratio in ratios if ratio is not None), default=None)
            cells = [
                f"**{_ratio(ratio)}**"
                if best is not None and ratio is not None and round(ratio, 2) == round(best, 2)
                else _ratio(ratio)
                for ratio in ratios
            ]
            lines.append(
                f"| {shape['shape']} | {size['capacity_blocks']} ({size['fraction']:.0%}) | "
                f"{size['belady_hit_rate']:.3f} | " + " | ".join(cells) + " |"
            )
    lines += [
        "",
        "Beside the best configuration above, as shares of Belady's: the best fixed content in "
        "hindsight (the blocks asked for most, each missing its first use) and `lru` and "
        "`kvfifo` with an admission that knows which blocks are asked for again (it saves "
        "none that no later request asks for): what knowing the trace's counts, or its reuse, "
        "would reach.",
        "",
        "| shape | pool (blocks) | best above | fixed best | "
        + " | ".join(f"{policy} knowing reuse" for policy in KNOWING_REUSE)
        + " |",
        "|---|---|---|---|" + "---|" * len(KNOWING_REUSE),
    ]
    for shape in shapes:
        for size in shape["sizes"]:
            best = max(
                (r["of_belady"] for r in size["configurations"] if r["of_belady"] is not None),
                default=None,
            )
            references = [
                size["references"][name]["of_belady"]
                for name in ("fixed_best", *(f"{p}_knowing_reuse" for p in KNOWING_REUSE))
            ]
            lines.append(
                f"| {shape['shape']} | {size['capacity_blocks']} ({size['fraction']:.0%}) | "
                f"{_ratio(best)} | " + " | ".join(_ratio(r) for r in references) + " |"
            )
    lines += [
        "",
        "Microseconds per block asked for, the mean over the shape's pool sizes "
        "(the index, its policy and admission; noisy, compare within one run).",
        "",
        "| shape | requests | block accesses | distinct blocks | "
        + " | ".join(configurations)
        + " |",
        "|---|---|---|---|" + "---|" * len(configurations),
    ]
    for shape in shapes:
        means = [
            sum(size["configurations"][i]["microseconds_per_block"] for size in shape["sizes"])
            / len(shape["sizes"])
            for i in range(len(configurations))
        ]
        lines.append(
            f"| {shape['shape']} | {shape['requests']} | {shape['block_accesses']} | "
            f"{shape['distinct_blocks']} | " + " | ".join(f"{mean:.1f}" for mean in means) + " |"
        )
    return [*lines, ""]


def _table(result: dict[str, Any]) -> str:
    lines = [
        *_shapes_table(result.get("shapes", [])),
        "The `mixed` shape at fixed pool sizes: "
        f"{result['requests']} requests, {result['block_accesses']} block accesses, "
        f"{result['distinct_blocks']} distinct blocks.",
        "",
        "| pool (blocks) | Belady | eviction | save_threshold | hit rate | of Belady "
        "| blocks saved | µs per block |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pool in result["pools"]:
        for row in pool["configurations"]:
            lines.append(
                f"| {pool['capacity_blocks']} | {pool['belady_hit_rate']:.3f} | "
                f"{row['eviction']} | {row['save_threshold']} | {row['hit_rate']:.3f} | "
                f"{row['of_belady']:.2f} | {row['saved_blocks']} | "
                f"{row['microseconds_per_block']:.1f} |"
            )
    lines += [
        "",
        "The pool in front of a disk that holds every block written to it: hits per tier, "
        "blocks computed, blocks written to the disk and blocks copied into the pool.",
        "",
        "| pool (blocks) | configuration | save_threshold | pool hit rate | of Belady "
        "| disk hit rate | blocks computed | blocks written to disk "
        "| blocks copied into the pool |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pool in result["pools"]:
        for row in pool["tiered"]:
            lines.append(
                f"| {pool['capacity_blocks']} | {row['configuration']} | "
                f"{row['save_threshold']} | {row['pool_hit_rate']:.3f} | "
                f"{row['pool_of_belady']:.2f} | {row['disk_hit_rate']:.3f} | "
                f"{row['computed_blocks']} | {row['disk_blocks_written']} | "
                f"{row['pool_blocks_copied']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(run_main("python -m benchmarks.tiers", run, None))
