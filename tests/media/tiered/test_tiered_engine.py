"""The tiered offload connector through kvwire's engine: outputs equal no connector's.

A pool that holds a few blocks in front of shared storage: evicted blocks
spill to disk and come back through the pool; write-through writes every
block; a failing tier costs hits, never outputs; a slow tier's lookups stay
off the scheduler's thread under `async_lookup`.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from kvwire.blocks.format import HEADER_SIZE
from kvwire.config import EngineConfig
from kvwire.engine.engine import LLMEngine, RequestOutput
from kvwire.media.store.directory.medium import DirectoryMedium
from kvwire.testing.faulty_medium import FaultInjectingMedium
from tests.support.engines import generate, renamed, served, tiny_config, tokens, with_connector
from tests.support.engines import workload as shared_prefix_workload
from tests.support.stores import DictMedium, DictStore

# One entry of tiny_config(): its header and one block of both layers (checked below).
ENTRY_BYTES = 2048 + HEADER_SIZE


def workload() -> list[Any]:
    return shared_prefix_workload(num_requests=16)


def tiered(
    directory: pathlib.Path, *, pool_blocks: int, write_policy: str, **extra: Any
) -> EngineConfig:
    tier = {"medium": "directory", "shared_storage_path": str(directory)}
    return with_connector(
        tiny_config(),
        "TieredOffloadConnector",
        {
            "cpu_pool_bytes": pool_blocks * ENTRY_BYTES,
            "write_policy": write_policy,
            "tiers": [tier],
            **extra,
        },
    )


def three_passes(config: EngineConfig) -> tuple[list[list[RequestOutput]], dict[str, Any]]:
    """A cold pass, then two warm ones with vLLM's own prefix cache emptied before each."""
    passes = []
    with LLMEngine(config) as engine:
        for name in ("", "-warm", "-again"):
            passes.append(engine.generate(renamed(workload(), name)))
            engine.reset_prefix_cache()
        stats = dict(engine.connector_stats.data)
    return passes, stats


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    return tokens(generate(tiny_config(), workload()))


def test_the_entry_size_the_pools_here_are_sized_by(tmp_path: pathlib.Path) -> None:
    config = tiered(tmp_path, pool_blocks=3, write_policy="spill")
    with LLMEngine(config) as engine:
        connector = engine.scheduler_connector
        assert connector is not None
        assert connector.medium.num_slots == 3  # type: ignore[attr-defined]


def test_a_spilling_pool_keeps_one_entry_in_sixteen_of_its_memory_as_a_spill_buffer(
    tmp_path: pathlib.Path,
) -> None:
    for policy, slots, buffers in (("spill", 30, 2), ("write_through", 32, 0)):
        with LLMEngine(tiered(tmp_path / policy, pool_blocks=32, write_policy=policy)) as engine:
            medium = engine.scheduler_connector.medium  # type: ignore[union-attr]
            assert (medium.num_slots, medium.spill_buffers) == (slots, buffers)


# 12 entries: no spill buffer, each promotion waits for its slot's spill; 24: one buffer.
@pytest.mark.parametrize("pool_blocks", [12, 24])
def test_spill_sends_evicted_blocks_to_disk_and_brings_them_back_through_the_pool(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]], pool_blocks: int
) -> None:
    passes, stats = three_passes(tiered(tmp_path, pool_blocks=pool_blocks, write_policy="spill"))
    for outputs in passes:
        assert tokens(outputs) == reference
    assert served(passes[1]) > 0
    assert stats["evicted_blocks"] > 0
    assert stats["tier1.spilled_blocks"] > 0
    assert stats["tier1.blocks_saved"] == stats["tier1.spilled_blocks"]
    # Brought from disk into the pool, then from the pool into the cache.
    assert stats["tier1.blocks_loaded"] == stats["tier1.promoted_blocks"] > 0
    assert stats["blocks_loaded"] > stats["tier1.blocks_loaded"]
    assert any(tmp_path.rglob("*.kv")) or stats["tier1.bytes_saved"] > 0


def test_spill_writes_nothing_while_the_pool_holds_every_block(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    passes, stats = three_passes(tiered(tmp_path, pool_blocks=200, write_policy="spill"))
    assert tokens(passes[2]) == reference
    assert stats.get("evicted_blocks", 0) == stats.get("tier1.blocks_saved", 0) == 0
    write_through = three_passes(
        tiered(tmp_path / "wt", pool_blocks=200, write_policy="write_through")
    )[1]
    assert write_through["tier1.blocks_saved"] == write_through["blocks_saved"] > 0


def test_write_through_writes_every_block_saved_and_eviction_spills_none(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    passes, stats = three_passes(tiered(tmp_path, pool_blocks=12, write_policy="write_through"))
    for outputs in passes:
        assert tokens(outputs) == reference
    # Every block whose pool save was made, once; blocks brought in from the tier are not.
    assert stats["tier1.written_through_blocks"] == stats["blocks_saved"] > 0
    assert "tier1.spilled_blocks" not in stats
    assert stats["tier1.promoted_blocks"] > 0


@pytest.mark.parametrize("write_policy", ["spill", "write_through"])
def test_without_promotion_tier_blocks_are_read_into_the_cache_and_the_pool_keeps_its_own(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]], write_policy: str
) -> None:
    config = tiered(tmp_path, pool_blocks=12, write_policy=write_policy, promotion="never")
    passes, stats = three_passes(config)
    for outputs in passes:
        assert tokens(outputs) == reference
    assert served(passes[1]) > 0
    # Every block the tier gave went straight into the cache: none into the pool.
    assert stats["tier1.blocks_loaded"] == stats["tier1.direct_blocks"] > 0
    assert "tier1.promoted_blocks" not in stats
    assert stats.get("load_errors", 0) == 0
    # The pool still serves the blocks it saved and kept (every block loaded
    # into the cache counts in blocks_loaded, the tier's too).
    assert stats["blocks_loaded"] > stats["tier1.blocks_loaded"]
    promoted = three_passes(tiered(tmp_path / "p", pool_blocks=12, write_policy=write_policy))[1]
    # A block the pool does not take in is not lost: the tier still holds it.
    assert stats["lookup_hit_blocks"] >= promoted["lookup_hit_blocks"]
    assert stats["evicted_blocks"] < promoted["evicted_blocks"]


@pytest.mark.parametrize("write_policy", ["spill", "write_through"])
def test_write_around_sends_the_blocks_the_pool_refuses_to_the_tier_from_the_cache(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]], write_policy: str
) -> None:
    def run(name: str, **extra: Any) -> tuple[list[list[RequestOutput]], dict[str, Any]]:
        config = tiered(
            tmp_path / name, pool_blocks=24, write_policy=write_policy, save_threshold=2, **extra
        )
        return three_passes(config)

    passes, stats = run("around", write_around=True)
    _, refused = run("dropped")
    for outputs in passes:
        assert tokens(outputs) == reference
    # The blocks the pool refused on first sight reached the tier, and came back from it.
    assert stats["tier1.written_around_blocks"] > 0
    assert stats["saves_not_admitted"] == refused["saves_not_admitted"] > 0
    assert stats["tier1.blocks_saved"] > refused.get("tier1.blocks_saved", 0)
    assert stats["lookup_hit_blocks"] > refused["lookup_hit_blocks"]
    assert stats.get("load_errors", 0) == 0


def cold_pass_counts(config: EngineConfig) -> dict[str, Any]:
    with LLMEngine(config) as engine:
        engine.generate(workload())
        engine.wait_for_saves()
        return dict(engine.connector_stats.data)


def test_write_through_writes_the_blocks_the_pool_saved_and_skips_those_it_had_no_slot_for(
    tmp_path: pathlib.Path,
) -> None:
    # Every request of the workload runs at once: each slot stays taken by its
    # block's save until the request that saved it ends (docs/tiers.md, Sizing the pool).
    small = cold_pass_counts(tiered(tmp_path / "s", pool_blocks=12, write_policy="write_through"))
    large = cold_pass_counts(tiered(tmp_path / "l", pool_blocks=128, write_policy="write_through"))
    assert small["tier1.written_through_blocks"] == small["blocks_saved"] == 12
    assert small.get("evicted_blocks", 0) == 0
    assert small["blocks_saved"] + small["stores_skipped_pool_full"] == large["blocks_saved"]
    # A pool that holds the running requests' blocks writes every one through.
    assert large.get("stores_skipped_pool_full", 0) == 0
    assert large["tier1.written_through_blocks"] == large["blocks_saved"]


class FailEveryLoad(FaultInjectingMedium):
    """Shared storage whose every request's first load leaves one bad block."""

    inner = DirectoryMedium


@pytest.mark.parametrize("promotion", ["always", "never"])
def test_a_tier_whose_loads_fail_costs_hits_never_outputs(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]], promotion: str
) -> None:
    faulty = {
        "medium": f"{FailEveryLoad.__module__}:FailEveryLoad",
        "shared_storage_path": str(tmp_path),
    }
    config = tiered(tmp_path, pool_blocks=12, write_policy="spill", promotion=promotion)
    assert config.kv_transfer_config is not None
    extra = {**config.kv_transfer_config.kv_connector_extra_config, "tiers": [faulty]}
    config = attrs.evolve(
        config,
        kv_transfer_config=attrs.evolve(config.kv_transfer_config, kv_connector_extra_config=extra),
    )
    passes, stats = three_passes(config)
    for outputs in passes:
        assert tokens(outputs) == reference
    assert sum(output.num_load_failures for outputs in passes for output in outputs) > 0
    assert stats["load_errors"] > 0


@pytest.mark.parametrize(
    "extra", [{}, {"save_threshold": 2, "write_around": True, "promotion": "never"}]
)
def test_a_tier_that_cannot_be_written_costs_hits_never_outputs(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]], extra: dict[str, Any]
) -> None:
    config = with_connector(
        tiny_config(),
        "TieredOffloadConnector",
        {
            **extra,
            "cpu_pool_bytes": 12 * ENTRY_BYTES,
            "write_policy": "spill",
            # A server nobody listens on: every write and lookup of the tier fails.
            "tiers": [{"medium": "redis", "url": "redis://127.0.0.1:9/0", "socket_timeout_s": 0.2}],
        },
    )
    started = time.monotonic()
    passes, stats = three_passes(config)
    for outputs in passes:
        assert tokens(outputs) == reference
    given = stats.get("tier1.spilled_blocks", 0) + stats.get("tier1.written_around_blocks", 0)
    assert given > 0
    assert stats.get("tier1.blocks_saved", 0) == 0
    assert time.monotonic() - started < 60


class FailOnePass(FaultInjectingMedium):
    """Shared storage whose loads fail, each at its first block, for the requests of one pass."""

    inner = DirectoryMedium
    fail_request_ids = frozenset(r.request_id + "-failing" for r in workload())
    fail_block_index = 0


# Short enough that a pass after the failing one starts with hits offered again.
BREAKER_PAUSE_S = 0.2


def failing_then_healthy_passes(
    directory: pathlib.Path, *, failing: bool, **extra: Any
) -> tuple[list[list[RequestOutput]], list[dict[str, float]]]:
    """A cold pass, a warm one, one whose tier loads fail (when `failing`), then five healthy.

    The outputs and the connector's counts of each pass after the cold one.
    """
    medium = f"{FailOnePass.__module__}:FailOnePass"
    tier = {"medium": medium, "shared_storage_path": str(directory)}
    config = tiered(
        directory, pool_blocks=12, write_policy="spill", load_pause_s=BREAKER_PAUSE_S, **extra
    )
    assert config.kv_transfer_config is not None
    transfer = config.kv_transfer_config
    options = {**transfer.kv_connector_extra_config, "tiers": [tier]}
    config = attrs.evolve(
        config, kv_transfer_config=attrs.evolve(transfer, kv_connector_extra_config=options)
    )
    names = ["", "-warm", "-failing" if failing else "-sound", *(f"-healthy{i}" for i in range(5))]
    passes, counts = [], []
    with LLMEngine(config) as engine:
        for name in names:
            before = dict(engine.connector_stats.data)
            passes.append(engine.generate(renamed(workload(), name)))
            engine.reset_prefix_cache()
            after = engine.connector_stats.data
            counts.append({key: after[key] - before.get(key, 0) for key in after})
            # The breaker's pause after the failing pass ends before the next pass.
            time.sleep(BREAKER_PAUSE_S * 1.5)
    return passes[1:], counts[1:]


@pytest.mark.slow
def test_after_a_pass_of_failed_tier_loads_the_next_passes_load_what_a_run_that_never_failed_does(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    passes, counts = failing_then_healthy_passes(tmp_path / "failing", failing=True)
    _, never_failed = failing_then_healthy_passes(tmp_path / "sound", failing=False)
    for outputs in passes:
        assert tokens(outputs) == reference
    assert counts[1].get("load_errors", 0) > 0
    healthy = counts[2:]
    assert [c.get("blocks_loaded", 0) for c in healthy] == [
        c.get("blocks_loaded", 0) for c in never_failed[2:]
    ]
    assert all(c.get("blocks_loaded", 0) > 0 for c in healthy)
    for name in ("load_blocks_missing", "load_errors", "load_pauses", "loads_failed"):
        assert sum(c.get(name, 0) for c in healthy) == 0, name


@pytest.mark.slow
def test_async_lookups_of_a_shared_prefix_load_every_block_they_count_after_failed_loads(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    # Every request's lookup runs before the first of them is loaded: they
    # count the same blocks, which one load brings in and the others share.
    passes, counts = failing_then_healthy_passes(tmp_path, failing=True, async_lookup=True)
    for outputs in passes:
        assert tokens(outputs) == reference
    assert sum(c.get("load_blocks_missing", 0) for c in counts) == 0
    healthy = counts[2:]
    assert sum(c.get("blocks_loaded", 0) for c in healthy) > 0
    for name in ("load_errors", "load_pauses", "loads_failed"):
        assert sum(c.get(name, 0) for c in healthy) == 0, name


class SlowStore(DictStore):
    """A store each lookup of which takes 50 ms."""

    entries: dict[str, bytes] = {}

    def count_prefix(self, keys: Sequence[str]) -> int:
        time.sleep(0.05)
        return super().count_prefix(keys)


class SlowMedium(DictMedium):
    store_class = SlowStore


def test_a_slow_tier_is_looked_up_off_the_scheduler_thread_with_async_lookup(
    reference: list[tuple[int, ...]],
) -> None:
    SlowStore.entries.clear()
    config = with_connector(
        tiny_config(),
        "TieredOffloadConnector",
        {
            "cpu_pool_bytes": 12 * ENTRY_BYTES,
            "write_policy": "write_through",
            "async_lookup": True,
            "lookup_deadline_s": 0.01,
            "tiers": [{"medium": f"{SlowMedium.__module__}:SlowMedium"}],
        },
    )
    with LLMEngine(config) as engine:
        connector = engine.scheduler_connector
        assert connector is not None
        for name in ("", "-warm"):
            # Each lookup answers at once; past its 10 ms deadline, a miss.
            outputs = engine.generate(renamed(workload(), name))
            assert tokens(outputs) == reference
            engine.reset_prefix_cache()
        stats = dict(engine.connector_stats.data)
    assert stats["lookups_late"] > 0
    SlowStore.entries.clear()
