"""Through the engine: a pool evicting by S3-FIFO or ARC, admitting or not, changes no output."""

from __future__ import annotations

import pytest

from kvwire.engine.engine import LLMEngine
from tests.support.engines import (
    generate,
    renamed,
    served,
    tiny_config,
    tokens,
    with_connector,
    workload,
)

# A pool far smaller than the workloads' blocks: it evicts all along.
POOL_BYTES = 48 * 1024


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    return tokens(generate(tiny_config(), workload()))


@pytest.mark.parametrize("save_threshold", [1, 2])
@pytest.mark.parametrize("eviction", ["s3fifo", "arc", "kvfifo"])
def test_a_pool_evicting_by_a_scan_resistant_policy_serves_identical_outputs(
    reference, eviction, save_threshold
):
    config = with_connector(
        tiny_config(),
        "CPUOffloadConnector",
        {"cpu_pool_bytes": POOL_BYTES, "eviction": eviction, "save_threshold": save_threshold},
    )
    with LLMEngine(config) as engine:
        runs = []
        for turn in range(3):
            runs.append(engine.generate(renamed(workload(), f"-{turn}")))
            engine.reset_prefix_cache()
        stats = engine.connector_stats.reduce()
    assert all(tokens(outputs) == reference for outputs in runs)
    assert served(runs[-1]) > 0
    assert stats["evicted_blocks"] > 0
    if save_threshold > 1:
        assert stats["saves_not_admitted"] > 0
