"""A hybrid engine loading from a connector per KV cache group, and recovering from failed loads.

The sliding-window group loads only the blocks inside the window at the
hit's end (the others are null blocks); a failed block in any group rolls
the request back to the first bad position over all groups (or further,
to where the sliding group still holds its window).
"""

from __future__ import annotations

import pathlib

import attrs
import pytest

from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.engines import generate, tiny_hybrid_config, tokens
from tests.support.media import (
    FailEveryFirstBlock,
    FailEveryLastBlock,
    over_medium,
    shared_storage,
)


def _workload() -> list[GenerationRequest]:
    spec = WorkloadSpec(
        num_requests=6, prompt_len=40, output_len=5, shared_prefix_ratio=0.6, vocab_size=300, seed=5
    )
    return synthetic_workload(spec)


def _config(store_dir: pathlib.Path, **flags: bool) -> EngineConfig:
    return attrs.evolve(
        tiny_hybrid_config(),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridDirectoryConnector",
            kv_connector_module_path="tests.support.directory_connectors",
            kv_role="kv_both",
            kv_connector_extra_config={"store_dir": str(store_dir), **flags},
        ),
    )


def _cold_then_warm(
    config: EngineConfig, **options: object
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    workload = _workload()
    with LLMEngine(config, **options) as engine:  # type: ignore[arg-type]
        assert engine.hma_enabled
        cold = engine.generate(workload)
        engine.wait_for_saves()
        engine.reset_prefix_cache()
        warm = engine.generate([attrs.evolve(r, request_id=f"{r.request_id}/w") for r in workload])
    return cold, warm


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    return tokens(generate(tiny_hybrid_config(), _workload()))


def test_warm_requests_load_their_prefix_per_group_and_generate_the_same_tokens(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    cold, warm = _cold_then_warm(_config(tmp_path))
    assert tokens(cold) == reference and tokens(warm) == reference
    assert all(output.external_tokens > 0 for output in warm)
    assert {path.name[:3] for path in tmp_path.iterdir()} == {"g0-", "g1-"}


def test_asynchronous_loads_generate_the_same_tokens(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    _cold, warm = _cold_then_warm(_config(tmp_path, load_async=True))
    assert tokens(warm) == reference
    assert sum(output.external_tokens for output in warm) > 0


@pytest.mark.parametrize("load_async", [False, True])
def test_a_failed_sliding_block_rolls_back_and_recomputes(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]], load_async: bool
) -> None:
    workload = _workload()
    # Fill the store first, with loads that work.
    generate(_config(tmp_path), workload)
    failing = _config(tmp_path, fail_loads=True, load_async=load_async)
    warm = generate(failing, [attrs.evolve(r, request_id=f"{r.request_id}/w") for r in workload])
    assert tokens(warm) == reference
    assert all(output.num_load_failures == 1 for output in warm)


def test_injected_failures_in_any_groups_block_are_recovered(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    # Loaded blocks come flattened over groups: index 0 is a full-group block.
    for index, medium in enumerate((FailEveryFirstBlock, FailEveryLastBlock)):
        config = shared_storage(tiny_hybrid_config(), tmp_path / str(index))
        _cold, warm = _cold_then_warm(config, container=over_medium(config, medium))
        assert tokens(warm) == reference
        assert all(output.num_load_failures == 1 for output in warm)


def test_the_sliding_group_loads_only_the_blocks_inside_the_window(
    tmp_path: pathlib.Path,
) -> None:
    prompt = tuple(range(1, 41))  # ten full blocks
    with LLMEngine(_config(tmp_path)) as engine:
        engine.generate([GenerationRequest("cold", prompt, 2)])
        engine.wait_for_saves()
        engine.reset_prefix_cache()
        engine.connector_stats.reset()
        [warm] = engine.generate([GenerationRequest("warm", prompt, 2)])
        loaded = engine.connector_stats.data["bytes_loaded"]
    assert warm.external_tokens == 39
    # The step computes token 39, which attends [32, 39]: blocks 8 and 9 of
    # the sliding group; the full group loads all ten. A block of a group
    # is its two layers' keys and values: 2 x 2 x 4 tokens x 2 heads x 16 x 4 bytes.
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4
    assert loaded == (10 + 2) * block_bytes
