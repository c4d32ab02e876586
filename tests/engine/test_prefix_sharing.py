"""Requests admitted in one step share their common prefix.

A block is published in the local prefix cache when it is scheduled, not
after the step that fills it (as vLLM's scheduler does): its keys and values
are written before any attention of the step reads them. So requests with a
common prefix hold one copy of it, loaded or computed once. Blocks a request
loads synchronously, and those it computes after them, are published after
the step, once the load is known sound: a request needing them waits a step
rather than compute on a load that may fail.
"""

from __future__ import annotations

import pathlib
from typing import Any

import attrs

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.engines import generate, tiny_config, tokens, with_directory_connector
from tests.support.media import FailFirstsFirstBlock, over_medium, shared_storage

PREFIX = tuple(range(100, 112))  # three blocks of four tokens


def _two_requests_with_a_common_prefix() -> list[GenerationRequest]:
    return [
        GenerationRequest("first", (*PREFIX, 1, 2, 3), max_tokens=4),
        GenerationRequest("second", (*PREFIX, 4, 5), max_tokens=4),
    ]


def test_the_second_request_of_a_step_finds_the_firsts_prefix_in_the_local_cache() -> None:
    outputs = generate(tiny_config(), _two_requests_with_a_common_prefix())
    assert [output.local_cached_tokens for output in outputs] == [0, len(PREFIX)]


def test_sharing_a_prefix_within_a_step_gives_the_tokens_of_running_alone() -> None:
    config = tiny_config()
    together = generate(config, _two_requests_with_a_common_prefix())
    alone = [generate(config, [request])[0] for request in _two_requests_with_a_common_prefix()]
    assert tokens(together) == tokens(alone)


def test_a_request_waits_for_a_load_of_its_prefix_and_is_spared_its_failure(
    tmp_path: pathlib.Path,
) -> None:
    config = tiny_config()
    workload = _two_requests_with_a_common_prefix()
    reference = tokens(generate(config, workload))
    connector_config = shared_storage(config, tmp_path)
    generate(connector_config, workload)  # fills the store
    container = over_medium(connector_config, FailFirstsFirstBlock)
    warm = generate(connector_config, workload, container=container)
    assert tokens(warm) == reference
    assert [output.num_load_failures for output in warm] == [1, 0]
    # The second shares what the first recomputed instead of loading a copy.
    assert [output.external_tokens for output in warm] == [0, 0]
    assert warm[1].local_cached_tokens == len(PREFIX)


def test_a_warm_pass_fits_where_a_copy_of_the_prefix_per_request_would_not(
    tmp_path: pathlib.Path,
) -> None:
    # 8 requests of 30 + 6 tokens (9 blocks each) sharing 4 full blocks: 44
    # blocks with one copy of the prefix, 72 with a copy each.
    spec = WorkloadSpec(
        num_requests=8, prompt_len=30, output_len=6, shared_prefix_ratio=0.6, vocab_size=300
    )
    workload = synthetic_workload(spec)
    config = tiny_config(num_gpu_blocks=48)
    reference = tokens(generate(config, workload))
    connector_config = with_directory_connector(config, tmp_path)
    generate(connector_config, workload)
    warm = generate(connector_config, workload)
    assert tokens(warm) == reference
    assert sum(output.num_preemptions for output in warm) == 0


def _warm_async(
    connector_config: EngineConfig, **options: Any
) -> tuple[list[RequestOutput], list[RequestOutput], dict[str, Any]]:
    workload = _two_requests_with_a_common_prefix()
    reference = generate(attrs.evolve(connector_config, kv_transfer_config=None), workload)
    generate(connector_config, workload)  # fills the store
    with LLMEngine(connector_config, **options) as engine:
        warm = engine.generate(workload)
        stats = dict(engine.connector_stats.data)
    return reference, warm, stats


def test_a_request_whose_prefix_a_parked_request_is_loading_waits_and_shares_it(
    tmp_path: pathlib.Path,
) -> None:
    connector_config = with_directory_connector(tiny_config(), tmp_path, load_async=True)
    reference, warm, stats = _warm_async(connector_config)
    assert tokens(warm) == tokens(reference)
    # "first" loads the three prefix blocks; "second" finds them in the local
    # cache once they land, instead of loading a copy of its own.
    assert [output.local_cached_tokens for output in warm] == [0, len(PREFIX)]
    assert warm[0].external_tokens == len(PREFIX)
    assert stats["blocks_loaded"] == 3


def test_a_failed_load_that_a_request_waited_for_is_recomputed_and_outputs_stay_equal(
    tmp_path: pathlib.Path,
) -> None:
    connector_config = shared_storage(tiny_config(), tmp_path, async_load=True)
    container = over_medium(connector_config, FailFirstsFirstBlock)
    reference, warm, _stats = _warm_async(connector_config, container=container)
    assert tokens(warm) == tokens(reference)
    assert warm[0].num_load_failures == 1
