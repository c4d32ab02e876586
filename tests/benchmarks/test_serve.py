"""The serving benchmark's bookkeeping: the counters it reads from ``/metrics``, its ratios
against the limit's run of the same seed, the fleet's figures and the README's table.

The servers and vLLM's client run only in the benchmark itself (``--only serve``).
"""

from __future__ import annotations

import pathlib
from typing import Any

import attrs
import pytest
from benchmarks.common import MIB
from benchmarks.serve_chunked import SINGLE
from benchmarks.serve_tp2 import TENSOR_PARALLEL_SIZE

from benchmarks import serve

SERVE_TP2_WORKLOAD = attrs.evolve(serve.FULL, tensor_parallel_size=TENSOR_PARALLEL_SIZE)

METRICS = """\
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="/m",source="local_compute"} 2048.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="/m",source="local_cache_hit"} 512.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="/m",source="external_kv_transfer"} 1024.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="/m",source="local_compute"} 1.7e9
vllm:prompt_tokens_total{engine="0",model_name="/m"} 3584.0
vllm:prefix_cache_hits_total{engine="0",model_name="/m"} 512.0
vllm:kvwire_blocks_loaded_total{engine="0",model_name="/m"} 6.0
vllm:kvwire_blocks_loaded_total{engine="1",model_name="/m"} 2.0
vllm:kvwire_blocks_loaded_created{engine="0",model_name="/m"} 1.7e9
vllm:generation_tokens_total{engine="0",model_name="/m"} 99.0
"""


def test_counters_are_read_by_source_summed_over_series_and_creation_times_left_out() -> None:
    assert serve.counters_of(METRICS) == {
        "prompt_tokens_local_compute": 2048.0,
        "prompt_tokens_local_cache_hit": 512.0,
        "prompt_tokens_external_kv_transfer": 1024.0,
        "prompt_tokens": 3584.0,
        "prefix_cache_hits": 512.0,
        "kvwire_blocks_loaded": 8.0,
    }


def a_run(seed: int, throughput: float, ttft: float, computed: list[float]) -> dict[str, Any]:
    figures = dict.fromkeys(serve.CLIENT_FIGURES, 1.0)
    figures.update(request_throughput=throughput, mean_ttft_ms=ttft, p99_ttft_ms=2 * ttft)
    figures["failed"] = 0
    return {
        "seed": seed,
        "client": figures,
        "first_errors": [],
        "generated_texts": ["a", "b", f"seed {seed}"],
        "servers": [{"prompt_tokens_local_compute": tokens} for tokens in computed],
    }


def summary() -> dict[str, Any]:
    single = {
        name: [a_run(0, 2.0, 100.0, [1000.0]), a_run(1, 2.0, 100.0, [900.0])]
        for name in serve.SINGLE
    }
    single[serve.LIMIT] = [a_run(0, 4.0, 50.0, [1000.0]), a_run(1, 5.0, 40.0, [900.0])]
    single["kvwire Redis"][1]["generated_texts"][0] = "another"
    fleet = {
        name: [a_run(0, 3.0, 80.0, [600.0, 600.0]), a_run(1, 3.0, 80.0, [450.0, 450.0])]
        for name in serve.FLEET
    }
    fleet[serve.FLEET_NONE] = [
        a_run(0, 1.5, 200.0, [1500.0, 1500.0]),
        a_run(1, 2.0, 150.0, [1400.0, 1400.0]),
    ]
    return serve.summarize(serve.QUICK, single, fleet)


def test_each_run_is_set_against_the_limit_s_run_of_the_same_seed() -> None:
    redis = summary()["configurations"]["kvwire Redis"]
    assert [row["throughput_vs_limit"] for row in redis] == [0.5, 0.4]
    assert [row["mean_ttft_vs_limit"] for row in redis] == [2.0, 2.5]
    assert [row["p99_ttft_vs_limit"] for row in redis] == [2.0, 2.5]
    assert [row["outputs_equal_limit"] for row in redis] == ["3/3", "2/3"]
    assert [row["computed_prompt_tokens"] for row in redis] == [1000.0, 900.0]


def test_a_fleet_is_set_against_one_server_of_its_kind_and_the_fleet_without_kvwire() -> None:
    configurations = summary()["configurations"]
    fleet = configurations["fleet: 2 servers, kvwire Redis"]
    assert [row["computed_prompt_tokens"] for row in fleet] == [1200.0, 900.0]
    assert [row["computed_vs_one_server"] for row in fleet] == [1.2, 1.0]
    assert [row["throughput_vs_fleet_without_kvwire"] for row in fleet] == [2.0, 1.5]
    without = configurations[serve.FLEET_NONE]
    assert [row["computed_vs_one_server"] for row in without] == [3.0, round(2800 / 900, 3)]


def test_the_table_gives_the_median_over_the_rounds_and_their_range() -> None:
    lines = serve.table(summary()).splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| config")]
    assert len(rows) == len(serve.SINGLE) + len(serve.FLEET)
    redis = next(line for line in lines if line.startswith("| kvwire Redis |"))
    assert "| 2.00 (2.00-2.00) |" in redis
    assert "| 0.45 (0.40-0.50) |" in redis
    assert "| 1000 / 900 |" in redis
    # Outputs must equal the limit's in every round: a round that differs shows.
    assert "| 3/3 / 2/3 (differ) |" in redis
    assert lines[0].startswith("2 interleaved rounds")


def test_the_ratios_are_summed_up_by_their_median_and_range_each_round_kept() -> None:
    result = summary()
    redis = result["spread"]["kvwire Redis"]
    assert redis["throughput_vs_limit"] == {"median": 0.45, "min": 0.4, "max": 0.5, "rounds": 2}
    assert result["repeats"] == 2
    assert len(result["configurations"]["kvwire Redis"]) == 2
    assert result["checks"]["kvwire Redis"]["outputs_equal_limit"] == {
        "same": False,
        "rounds": ["3/3", "2/3"],
    }
    assert serve.headline(result)["kvwire Redis"]["throughput_vs_limit"]["median"] == 0.45


def test_the_full_workload_does_not_fit_vllm_s_cache_but_its_running_requests_do() -> None:
    for workload in (serve.FULL, serve.QUICK):
        request_tokens = workload.prefix_len + workload.suffix_len + workload.output_len
        running_bytes = workload.concurrency * request_tokens * serve.KV_BYTES_PER_TOKEN
        assert running_bytes < workload.kv_cache_bytes < workload.prefix_kv_bytes


def test_the_chunked_prefill_run_sets_the_media_against_its_own_limit_without_fleets() -> None:
    single = {name: [a_run(0, 3.0, 60.0, [500.0]), a_run(1, 3.0, 60.0, [400.0])] for name in SINGLE}
    single[serve.LIMIT] = [a_run(0, 4.0, 50.0, [500.0]), a_run(1, 3.0, 40.0, [400.0])]
    workload = attrs.evolve(serve.QUICK, max_num_batched_tokens=2048)

    summary = serve.summarize(workload, single, {})

    assert list(summary["configurations"]) == list(SINGLE)
    assert summary["workload"]["max_num_batched_tokens"] == 2048
    offload = summary["configurations"]["kvwire CPU offload"]
    assert [row["throughput_vs_limit"] for row in offload] == [0.75, 1.0]
    assert [row["mean_ttft_vs_limit"] for row in offload] == [1.2, 1.5]
    assert len(serve.table(summary).splitlines()) == 4 + len(SINGLE)


def a_bench(workload: serve.Workload, scratch: pathlib.Path) -> serve.Bench:
    # The client is never started: these tests only ask for arguments.
    return serve.Bench("/m", workload, scratch, "redis://127.0.0.1:1/0", client=None)  # type: ignore[arg-type]


def test_an_async_load_configuration_is_its_medium_s_profile_with_async_load_on(
    tmp_path: pathlib.Path,
) -> None:
    bench = a_bench(serve.FULL, tmp_path)

    plain = bench.transfer_config("kvwire Redis", "plain")
    background = bench.transfer_config(f"kvwire Redis, {serve.ASYNC_LOAD}", "background")

    assert plain is not None and background is not None
    plain_options = plain["kv_connector_extra_config"]["kvwire"]["kv_transfer_config"]
    options = background["kv_connector_extra_config"]["kvwire"]["kv_transfer_config"]
    assert "async_load" not in plain_options["kv_connector_extra_config"]
    assert options["kv_connector_extra_config"]["async_load"] is True
    assert options["kv_connector"] == plain_options["kv_connector"] == "RedisConnector"
    with pytest.raises(ValueError, match="unknown variant 'eager' of 'Redis'"):
        bench.transfer_config("kvwire Redis, eager", "eager")


def test_at_tensor_parallelism_2_each_rank_gets_half_the_cache_and_a_core_of_its_own(
    tmp_path: pathlib.Path,
) -> None:
    split = a_bench(SERVE_TP2_WORKLOAD, tmp_path).server_args(256 * MIB, None)
    whole = a_bench(serve.FULL, tmp_path).server_args(256 * MIB, None)

    assert split[split.index("--kv-cache-memory-bytes") + 1] == str(128 * MIB)
    assert whole[whole.index("--kv-cache-memory-bytes") + 1] == str(256 * MIB)
    assert split[split.index("--tensor-parallel-size") + 1] == "2"
    assert "--distributed-executor-backend" in split
    assert "--tensor-parallel-size" not in whole
