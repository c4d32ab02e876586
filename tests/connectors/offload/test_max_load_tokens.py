"""`max_load_tokens` in a request's `kv_transfer_params`: at most that many tokens loaded.

Past the request's local hit, in whole blocks; the rest is computed. A value
that is no count of tokens is ignored with a warning. Through the engine,
outputs equal outputs without a connector.
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from kvwire.blocks.groups import CacheGroup
from kvwire.connectors.offload._planner import BlockPlanner
from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.interface.types import BlockHash, KVCacheBlocks, Request, SchedulerOutput
from kvwire.media.base import MediumIndex
from tests.support.engines import (
    generate,
    served,
    tiered_disk,
    tiny_config,
    tokens,
    with_connector,
    workload,
)

BLOCK = 4
HASHES = [bytes([n]) * 8 for n in range(4)]


class HoldsAll(MediumIndex):
    """Holds every block asked about; answers on any thread."""

    concurrent_lookups = True

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        return len(block_hashes)


def scheduler_half(*, deadline_s: float | None = None) -> OffloadSchedulerHalf:
    planner = BlockPlanner(BLOCK, [CacheGroup(0, ("layers.0",), BLOCK)], loads=True, saves=True)
    return OffloadSchedulerHalf(
        index=HoldsAll(),
        planner=planner,
        num_groups=1,
        async_load=False,
        lookup_deadline_s=deadline_s,
    )


def request_of(params: dict[str, Any] | None) -> Request:
    """A prompt of four full blocks and one token more, all of them held by the medium."""
    return Request(
        request_id="r",
        prompt_token_ids=list(range(4 * BLOCK + 1)),
        max_tokens=1,
        block_hashes=list(HASHES),
        kv_transfer_params=params,
    )


def matched(max_load_tokens: object, num_computed_tokens: int = 0) -> int | None:
    half = scheduler_half()
    try:
        hit, _ = half.get_num_new_matched_tokens(
            request_of({"max_load_tokens": max_load_tokens}), num_computed_tokens
        )
    finally:
        half.close()
    return hit


def test_a_cap_of_zero_loads_nothing() -> None:
    assert matched(0) == 0


def test_a_cap_below_the_hit_is_rounded_down_to_whole_blocks() -> None:
    assert matched(2 * BLOCK + 3) == 2 * BLOCK
    assert matched(BLOCK - 1) == 0


def test_the_cap_counts_from_the_local_hit() -> None:
    assert matched(BLOCK, num_computed_tokens=2 * BLOCK) == BLOCK


@pytest.mark.parametrize("cap", [4 * BLOCK, 1000, None])
def test_a_cap_at_or_above_the_hit_changes_nothing(cap: int | None) -> None:
    assert matched(cap) == 4 * BLOCK


def test_a_request_without_params_loads_its_whole_hit() -> None:
    half = scheduler_half()
    try:
        assert half.get_num_new_matched_tokens(request_of(None), 0) == (4 * BLOCK, False)
    finally:
        half.close()


@pytest.mark.parametrize("bad", [-1, 2.0, True, "8", [8], "x" * 10_000])
def test_a_bad_cap_is_ignored_with_a_warning_that_does_not_echo_it(
    bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvwire.connectors.offload.scheduler"):
        assert matched(bad) == 4 * BLOCK
    [record] = caplog.records
    assert "kv_transfer_params.max_load_tokens" in record.getMessage()
    assert "integer >= 0" in record.getMessage()
    assert len(record.getMessage()) < 500


def test_capped_blocks_are_counted_once_the_request_is_allocated() -> None:
    half = scheduler_half()
    request = request_of({"max_load_tokens": BLOCK})
    try:
        assert half.get_num_new_matched_tokens(request, 0) == (BLOCK, False)
        half.update_state_after_alloc(request, KVCacheBlocks(([1, 2, 3, 4, 5],)), BLOCK)
        counters = dict(half.build_connector_meta(SchedulerOutput(scheduled=[])).counters)
    finally:
        half.close()
    # Three of the four hit blocks lie past the cap.
    assert counters["load_blocks_capped"] == 3
    assert counters["lookup_hit_blocks"] == 1


def test_an_async_lookup_asks_only_within_the_cap() -> None:
    half = scheduler_half(deadline_s=600.0)
    request = request_of({"max_load_tokens": 2 * BLOCK})
    try:
        for _ in range(6000):
            hit, _ = half.get_num_new_matched_tokens(request, 0)
            if hit is not None:
                break
            time.sleep(0.005)
        assert hit == 2 * BLOCK
    finally:
        half.close()


def capped(requests: list[GenerationRequest], max_load_tokens: int) -> list[GenerationRequest]:
    return [
        attrs.evolve(
            r,
            request_id=f"{r.request_id}-capped",
            kv_transfer_params={"max_load_tokens": max_load_tokens},
        )
        for r in requests
    ]


def run(
    config: Any, requests: list[GenerationRequest]
) -> tuple[list[RequestOutput], dict[str, Any]]:
    with LLMEngine(config) as engine:
        cold = engine.generate(requests)
        engine.reset_prefix_cache()
        warm = engine.generate(capped(requests, config.cache_config.block_size))
    return cold + warm, engine.connector_stats.reduce()


@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_the_engine_with_a_cap_keeps_its_outputs_and_loads_at_most_the_cap(
    async_load: bool,
) -> None:
    requests = workload()
    reference = tokens(generate(tiny_config(), requests))
    config = with_connector(
        tiny_config(), "CPUOffloadConnector", {"cpu_pool_bytes": "8MiB", "async_load": async_load}
    )
    outputs, stats = run(config, requests)
    cold, warm = outputs[: len(requests)], outputs[len(requests) :]
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    block_size = tiny_config().cache_config.block_size
    assert 0 < served(warm) <= len(requests) * block_size
    assert all(output.external_tokens <= block_size for output in warm)
    assert stats["load_blocks_capped"] > 0


def test_under_a_multi_connector_the_child_that_loads_applies_the_cap(
    tmp_path: pathlib.Path,
) -> None:
    requests = workload()
    reference = tokens(generate(tiny_config(), requests))
    config = tiered_disk(tiny_config(), tmp_path)
    generate(config, requests)  # fills the disk tier
    block_size = config.cache_config.block_size
    # A fresh engine: its CPU tier is empty, the disk tier answers.
    with LLMEngine(config) as engine:
        warm = engine.generate(capped(requests, block_size))
        stats = engine.connector_stats.reduce()
    assert tokens(warm) == reference
    assert 0 < served(warm) <= len(requests) * block_size
    assert all(output.external_tokens <= block_size for output in warm)
    assert stats["SharedStorageConnector"]["load_blocks_capped"] > 0
