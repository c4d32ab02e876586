"""The engine drives a connector with vLLM's semantics, and outputs never change.

Every test compares the tokens generated with a connector to the tokens the
same model generates without one: that equality is the engine's invariant.
"""

from __future__ import annotations

import pathlib

import attrs
import pytest

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import RequestStatus
from kvwire.testing.instruments import CallLog, Instruments
from tests.support.engines import generate, served, tiny_config, tokens, with_directory_connector
from tests.support.media import FailEverySecondBlock, over_medium, shared_storage

Workload = list[GenerationRequest]


def _cold_then_warm(config: EngineConfig, workload: Workload, **options: object) -> tuple:
    cold = generate(config, workload, **options)
    warm = generate(config, workload, **options)
    return cold, warm


@pytest.mark.parametrize(
    "behaviour",
    [{}, {"load_async": True}, {"answer_none_first": True}, {"keep_blocks_until_sent": True}],
    ids=["sync", "async-load", "none-then-answer", "delayed-free"],
)
def test_outputs_equal_no_connector_cold_and_warm(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path, behaviour: dict[str, bool]
) -> None:
    reference = tokens(generate(config, workload))
    cold, warm = _cold_then_warm(with_directory_connector(config, tmp_path, **behaviour), workload)
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    assert served(cold) == 0
    assert served(warm) > 0


def test_the_same_engine_reuses_its_local_prefix_cache(
    config: EngineConfig, workload: Workload
) -> None:
    with LLMEngine(config) as engine:
        first = engine.generate(workload)
        again = engine.generate(
            [attrs.evolve(r, request_id=r.request_id + "-again") for r in workload]
        )
    assert tokens(again) == tokens(first)
    assert sum(output.local_cached_tokens for output in again) > 0


def test_a_request_answered_none_is_asked_again_next_step(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    connector_config = with_directory_connector(config, tmp_path, answer_none_first=True)
    log = CallLog()
    generate(connector_config, workload[:1], connector_hook=Instruments(log=log))
    scheduler_calls = [
        (record.method, record.detail)
        for record in log.of_role(KVConnectorRole.SCHEDULER)
        if record.method in ("get_num_new_matched_tokens", "build_connector_meta")
    ][:3]
    assert scheduler_calls == [
        ("get_num_new_matched_tokens", "req-0"),
        ("build_connector_meta", ()),
        ("get_num_new_matched_tokens", "req-0"),
    ]


def test_an_async_load_parks_the_request_until_the_worker_reports_it_received(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    connector_config = with_directory_connector(config, tmp_path, load_async=True)
    generate(connector_config, workload[:1])
    log = CallLog()
    generate(connector_config, workload[:1], connector_hook=Instruments(log=log))
    received_at = next(
        index
        for index, record in enumerate(log.records)
        if record.method == "get_finished" and record.result[1]
    )
    first_scheduled_at = next(
        index
        for index, record in enumerate(log.records)
        if record.method == "build_connector_meta" and "req-0" in record.detail
    )
    assert received_at < first_scheduled_at


def test_blocks_kept_by_request_finished_are_freed_once_reported_sent(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    connector_config = with_directory_connector(config, tmp_path, keep_blocks_until_sent=True)
    with LLMEngine(connector_config) as engine:
        engine.add_request(workload[0])
        while not engine.scheduler.requests["req-0"].is_finished:
            engine.step()
        held_after_finish = engine.scheduler.block_manager.num_free_blocks
        engine.run_until_done()
        output = engine.output_of("req-0")
        assert held_after_finish < config.cache_config.num_gpu_blocks
        assert engine.scheduler.block_manager.num_free_blocks == config.cache_config.num_gpu_blocks
    assert output.kv_transfer_params == {"stored_in": str(tmp_path)}


def test_failed_loads_are_recomputed_and_outputs_stay_equal(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    reference = tokens(generate(config, workload))
    connector_config = with_directory_connector(config, tmp_path, fail_loads=True)
    _cold, warm = _cold_then_warm(connector_config, workload)
    assert tokens(warm) == reference
    assert all(output.num_load_failures == 1 for output in warm)


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_garbage_left_by_a_failed_load_never_reaches_the_outputs(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path, load_async: bool
) -> None:
    reference = tokens(generate(config, workload))
    connector_config = shared_storage(config, tmp_path, async_load=load_async)
    generate(connector_config, workload)
    # Each request's first load leaves NaN in its second block, and reports it.
    container = over_medium(connector_config, FailEverySecondBlock)
    warm = generate(connector_config, workload, container=container)
    assert tokens(warm) == reference
    assert sum(output.num_load_failures for output in warm) == len(workload)


def test_a_failed_load_under_the_fail_policy_ends_the_request_with_a_clear_error(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    connector_config = with_directory_connector(config, tmp_path, policy="fail", fail_loads=True)
    generate(connector_config, workload[:1])
    (failed,) = generate(connector_config, workload[:1])
    assert failed.status is RequestStatus.FINISHED_ERROR
    assert failed.error is not None
    assert failed.error.startswith("request 'req-0': the connector failed to load KV blocks [")
    assert "kv_transfer_config.kv_load_failure_policy is 'fail'" in failed.error


def test_preemption_under_a_small_cache_keeps_outputs_equal(
    workload: Workload, tmp_path: pathlib.Path
) -> None:
    reference = tokens(generate(tiny_config(), workload))
    small = tiny_config(num_gpu_blocks=24)
    connector_config = with_directory_connector(small, tmp_path)
    with LLMEngine(small) as engine:
        assert tokens(engine.generate(workload)) == reference
        assert engine.counters.preemptions > 0
    cold, warm = _cold_then_warm(connector_config, workload)
    assert tokens(cold) == reference and tokens(warm) == reference


@pytest.mark.slow
def test_a_worker_in_its_own_process_gives_equal_outputs(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    reference = tokens(generate(config, workload))
    connector_config = with_directory_connector(config, tmp_path)
    cold, warm = _cold_then_warm(connector_config, workload, worker_mode="process")
    assert tokens(cold) == reference and tokens(warm) == reference
    assert served(warm) > 0


def test_loaded_kv_is_bit_identical_to_the_kv_computed_without_a_connector(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    import torch

    with LLMEngine(config, capture_kv=True) as engine:
        engine.generate(workload)
        computed = engine.captured_kv
    connector_config = with_directory_connector(config, tmp_path)
    generate(connector_config, workload)
    with LLMEngine(connector_config, capture_kv=True) as engine:
        warm = engine.generate(workload)
        loaded = engine.captured_kv
    for output in warm:
        assert output.external_tokens > 0
        assert torch.equal(loaded[output.request_id], computed[output.request_id])


def test_prompts_longer_than_the_token_budget_are_prefilled_in_chunks_with_equal_outputs(
    workload: Workload, tmp_path: pathlib.Path
) -> None:
    reference = tokens(generate(tiny_config(), workload))
    chunked = attrs.evolve(
        tiny_config(),
        scheduler_config=attrs.evolve(tiny_config().scheduler_config, max_num_batched_tokens=12),
    )
    with LLMEngine(chunked) as engine:
        engine.generate(workload[:1])
        # 30 prompt tokens at 12 a step: 3 prefill steps give the first token, 5 decode the rest.
        assert engine.counters.steps == 3 + 5
    with LLMEngine(chunked) as engine:
        assert tokens(engine.generate(workload)) == reference
    cold, warm = _cold_then_warm(with_directory_connector(chunked, tmp_path), workload)
    assert tokens(cold) == reference and tokens(warm) == reference


def test_no_more_than_max_num_seqs_requests_run_at_once(workload: Workload) -> None:
    config = attrs.evolve(
        tiny_config(), scheduler_config=attrs.evolve(tiny_config().scheduler_config, max_num_seqs=2)
    )
    with LLMEngine(config) as engine:
        for request in workload:
            engine.add_request(request)
        most_running = 0
        while engine.scheduler.has_unfinished_work():
            engine.step()
            most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == 2


def test_an_hma_connector_is_told_of_finished_requests_for_all_groups(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    connector_config = with_directory_connector(config, tmp_path)
    assert connector_config.kv_transfer_config is not None
    hma = attrs.evolve(
        connector_config,
        kv_transfer_config=attrs.evolve(
            connector_config.kv_transfer_config,
            kv_connector="HMADirectoryConnector",
            kv_connector_module_path="tests.support.misbehaving_connectors",
        ),
    )
    outputs = generate(hma, workload[:2])
    assert [output.kv_transfer_params for output in outputs] == [{"groups": 1}, {"groups": 1}]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_caches_keep_outputs_equal(
    workload: Workload, tmp_path: pathlib.Path, dtype: str
) -> None:
    config = tiny_config()
    config = attrs.evolve(config, model_config=attrs.evolve(config.model_config, dtype=dtype))
    reference = tokens(generate(config, workload))
    cold, warm = _cold_then_warm(with_directory_connector(config, tmp_path), workload)
    assert tokens(cold) == reference and tokens(warm) == reference
    assert served(warm) > 0


def test_with_local_prefix_caching_off_the_connector_serves_every_shared_block(
    workload: Workload, tmp_path: pathlib.Path
) -> None:
    config = tiny_config(enable_prefix_caching=False)
    reference = tokens(generate(config, workload))
    _cold, warm = _cold_then_warm(with_directory_connector(config, tmp_path), workload)
    assert tokens(warm) == reference
    assert all(output.local_cached_tokens == 0 for output in warm)
    assert all(output.external_tokens >= 16 for output in warm)  # the 18-token shared prefix


def test_requests_whose_loads_fill_the_cache_do_not_deadlock(tmp_path: pathlib.Path) -> None:
    # Two 33-token prompts each load 8 of the 16 blocks asynchronously, then each
    # needs a 9th: one of them must give its blocks back for the other to run.
    import random

    rng = random.Random(1)
    workload = [
        GenerationRequest(f"r{i}", tuple(rng.randrange(300) for _ in range(33)), 3)
        for i in range(2)
    ]
    config = tiny_config(num_gpu_blocks=16)
    reference = tokens(generate(config, workload))
    connector_config = with_directory_connector(config, tmp_path, load_async=True)
    generate(connector_config, workload)
    warm = generate(connector_config, workload)
    assert tokens(warm) == reference
    assert [output.num_preemptions for output in warm] == [0, 1]
