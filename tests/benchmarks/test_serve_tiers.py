"""The tiered serving benchmark's trace as prompts, its model of vLLM's cache, the
configurations it serves and its bookkeeping.

The servers and vLLM's client run only in the benchmark itself (``--only serve-tiers``).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import attrs
import pytest

from benchmarks import serve, tiers
from benchmarks import serve_tiers as bench
from kvwire.config.profile import load_profile

SMALL = attrs.evolve(tiers.FULL, requests=80)


@pytest.fixture(scope="module")
def trace() -> tiers.Trace:
    return tiers.generate_trace(SMALL)


def blocks(text: str) -> list[bytes]:
    return [letter.encode() for letter in text]


def test_a_block_is_a_block_of_words_whose_first_two_spell_its_number() -> None:
    number = 5 * len(bench.WORDS) + 7
    tokens = bench.block_tokens(number.to_bytes(8, "big"))

    assert len(tokens) == bench.BLOCK_SIZE
    assert tokens[:2] == [bench.WORDS[5], bench.WORDS[7]]
    assert set(tokens) <= set(bench.WORDS)
    assert tokens == bench.block_tokens(number.to_bytes(8, "big"))
    assert tokens != bench.block_tokens((number + 1).to_bytes(8, "big"))


def test_a_block_past_what_two_words_name_is_refused() -> None:
    with pytest.raises(ValueError, match="two words"):
        bench.block_tokens((len(bench.WORDS) ** 2).to_bytes(8, "big"))


def test_every_word_reads_as_one_token_and_fits_vllm_s_characters_per_token() -> None:
    # The tokenizer matches its special words t0, t1, t2 inside any word first.
    for word in bench.WORDS:
        text = f"t{word}"
        assert not text.startswith(("t0", "t1", "t2"))
        assert len(text) + 1 <= bench.LONGEST_WORD_CHARS


def test_prompts_share_whole_blocks_exactly_where_the_trace_does(trace: tiers.Trace) -> None:
    prompts = [bench.prompt_tokens(hashes) for hashes in trace]
    for hashes, prompt in zip(trace, prompts, strict=True):
        assert len(prompt) == len(hashes) * bench.BLOCK_SIZE + 1
    for first in range(len(trace)):
        for second in range(first + 1, len(trace)):
            shared_blocks = common_prefix(trace[first], trace[second])
            shared_tokens = common_prefix(prompts[first], prompts[second])
            # The last word may match the next block's first word: never a whole block.
            assert shared_tokens // bench.BLOCK_SIZE == shared_blocks


def common_prefix(first: list[Any], second: list[Any]) -> int:
    length = 0
    for ours, theirs in zip(first, second, strict=False):
        if ours != theirs:
            break
        length += 1
    return length


def test_the_dataset_is_vllm_s_custom_jsonl_in_the_trace_s_order(
    trace: tiers.Trace, tmp_path: pathlib.Path
) -> None:
    prompts = [bench.prompt_tokens(hashes) for hashes in trace]
    path = tmp_path / "trace.jsonl"

    bench.write_dataset(path, prompts, output_len=2)

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["output_tokens"] for line in lines] == [2] * len(trace)
    assert [line["prompt"].split() for line in lines] == [
        [f"t{token}" for token in prompt] for prompt in prompts
    ]


def test_vllm_s_cache_is_taken_least_recently_freed_first_a_prefix_from_its_tail() -> None:
    # 5 blocks, one of them vLLM's null block. "ab" takes 3 (a, b and the last word's);
    # freed, the last word's block comes first, then b's, then a's. "cd" takes the free
    # block, the last word's and b's; "ab" then finds a but not b.
    misses = bench.vllm_cache_misses([blocks("ab"), blocks("cd"), blocks("ab")], 5)

    assert misses == [blocks("ab"), blocks("cd"), blocks("b")]


def test_vllm_s_cache_keeps_what_fits() -> None:
    trace = [blocks("ab"), blocks("abc"), blocks("ab")]

    assert bench.vllm_cache_misses(trace, 6) == [blocks("ab"), blocks("c"), []]


def test_the_trace_s_facts_count_its_blocks_and_bound_the_pool_with_belady() -> None:
    trace = [blocks("ab"), blocks("cd"), blocks("ab"), blocks("abe")]

    facts = bench.trace_facts(trace, primary_blocks=2, vllm_cache_blocks=5)

    assert facts["block_accesses"] == 9
    assert facts["distinct_blocks"] == 5
    assert facts["limit_computed_tokens"] == 5 * bench.BLOCK_SIZE + 4
    assert facts["reuse_hit_rate"] == pytest.approx(4 / 9)
    accesses = blocks("abcdababe")
    assert facts["belady_primary_hit_rate"] == tiers.belady_hits(accesses, 2) / 9
    behind = [block for hashes in bench.vllm_cache_misses(trace, 5) for block in hashes]
    assert facts["belady_primary_behind_vllm_hit_rate"] == tiers.belady_hits(behind, 2) / 9
    assert facts["no_connector_computed_tokens"] == len(behind) * bench.BLOCK_SIZE + 4


def test_the_servers_hold_the_longest_prompt_and_the_limit_every_block(
    trace: tiers.Trace,
) -> None:
    prompts = [bench.prompt_tokens(hashes) for hashes in trace]
    longest_chars = max(len(bench.prompt_text(prompt)) for prompt in prompts)

    sizes = bench.server_sizes(bench.QUICK, trace, longest_chars)

    longest = max(len(prompt) for prompt in prompts)
    assert sizes["max_model_len"] >= longest + bench.QUICK.output_len
    assert sizes["max_model_len"] * bench.LONGEST_WORD_CHARS >= longest_chars
    assert sizes["vllm_cache_blocks"] * bench.BLOCK_SIZE > sizes["max_model_len"]
    distinct = len({block for hashes in trace for block in hashes})
    assert sizes["limit_cache_blocks"] > distinct + sizes["vllm_cache_blocks"]


def by_name(name: str) -> bench.Configuration:
    return next(config for config in bench.CONFIGURATIONS if config.name == name)


def by_kind(kind: str) -> bench.Configuration:
    return next(config for config in bench.CONFIGURATIONS if config.kind == kind)


def test_every_kvwire_configuration_is_a_profile_kvwire_reads(tmp_path: pathlib.Path) -> None:
    for config in bench.CONFIGURATIONS:
        if config.eviction == bench.BEST:
            config = attrs.evolve(config, eviction="arc", write_policy="spill")
        transfer = bench.transfer_config(config, tmp_path, primary_blocks=64)
        if config.kind in ("limit", "none"):
            assert transfer is None
            continue
        assert transfer is not None
        assert transfer["kv_load_failure_policy"] == "recompute"
        if config.kind == "example":
            assert transfer["kv_connector"] == "ExampleConnector"
            continue
        assert transfer["kv_connector"] == "KVWireConnector"
        load_profile(transfer["kv_connector_extra_config"]["kvwire"])


def test_the_tiered_rows_set_their_policies_and_a_pool_of_the_primary_s_blocks(
    tmp_path: pathlib.Path,
) -> None:
    config = bench.tiered("s3fifo", "spill", save_threshold=2)

    transfer = bench.transfer_config(config, tmp_path, primary_blocks=64)

    assert transfer is not None
    options = transfer["kv_connector_extra_config"]["kvwire"]["kv_transfer_config"]
    assert options["kv_connector"] == "TieredOffloadConnector"
    extra = options["kv_connector_extra_config"]
    assert (extra["eviction"], extra["save_threshold"], extra["write_policy"]) == (
        "s3fifo",
        2,
        "spill",
    )
    # The pool's slot: a block of every layer and a 128-byte header.
    assert extra["cpu_pool_bytes"] == 64 * (bench.BLOCK_BYTES + 128)
    (tier,) = extra["tiers"]
    assert tier["medium"] == "directory"
    assert pathlib.Path(tier["shared_storage_path"]).parent == tmp_path


def test_the_multi_connector_row_is_a_pool_then_a_disk_each_written(
    tmp_path: pathlib.Path,
) -> None:
    config = next(config for config in bench.CONFIGURATIONS if config.kind == "multi")

    transfer = bench.transfer_config(config, tmp_path, primary_blocks=64)

    assert transfer is not None
    options = transfer["kv_connector_extra_config"]["kvwire"]["kv_transfer_config"]
    cpu, disk = options["kv_connector_extra_config"]["connectors"]
    assert cpu["kv_connector"] == "CPUOffloadConnector"
    assert cpu["kv_connector_extra_config"]["cpu_pool_bytes"] == bench.pool_bytes(64)
    assert disk["kv_connector"] == "SharedStorageConnector"


def test_quick_runs_one_configuration_of_each_kind_the_limit_first() -> None:
    quick = [config for config in bench.CONFIGURATIONS if config.quick]

    assert quick[0].name == bench.LIMIT
    assert sorted(config.kind for config in quick) == sorted(bench.KINDS)
    names = [config.name for config in bench.CONFIGURATIONS]
    assert len(set(names)) == len(names)
    best = names.index(by_name("tiered: the best above, save_threshold 2").name)
    assert any(config.kind == "tiered" for config in bench.CONFIGURATIONS[:best])


def chosen_by(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], tmp_path: pathlib.Path
) -> tuple[bench.Workload, list[str], int]:
    """What ``python -m benchmarks.serve_tiers ARGV`` would measure: workload, names, rounds."""
    chosen: list[tuple[bench.Workload, list[str], int]] = []

    def measure(
        _: pathlib.Path, workload: bench.Workload, configs: list[bench.Configuration], repeats: int
    ) -> dict[str, Any]:
        chosen.append((workload, [config.name for config in configs], repeats))
        return {}

    monkeypatch.setattr(bench, "measure_tiers", measure)
    assert bench.main([*argv, "--output-dir", str(tmp_path)]) == 0
    return chosen[0]


def test_kinds_choose_the_configurations_the_limit_always_among_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    workload, names, repeats = chosen_by(
        monkeypatch, ["--quick", "--kinds", "cpu", "none", "--repeats", "5"], tmp_path
    )
    assert workload == bench.QUICK
    assert names == [bench.LIMIT, bench.NO_CONNECTOR, by_kind("cpu").name]
    assert repeats == 5

    workload, names, repeats = chosen_by(monkeypatch, ["--kinds", "tiered"], tmp_path)
    assert workload == bench.FULL
    assert names == [bench.LIMIT] + [c.name for c in bench.CONFIGURATIONS if c.kind == "tiered"]
    assert repeats == 3


def test_an_unknown_kind_is_refused_naming_the_kinds_there_are(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        chosen_by(monkeypatch, ["--kinds", "tierd"], tmp_path)
    assert "invalid choice: 'tierd'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"\['tierd'\] are not configurations' kinds"):
        bench.run(tmp_path, quick=True, kinds=["cpu", "tierd"])


METRICS = """\
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 3000.0
vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 640.0
vllm:kvwire_lookup_hit_blocks_total{engine="0"} 22.0
vllm:kvwire_blocks_loaded_total{engine="0"} 20.0
vllm:kvwire_bytes_saved_total{engine="0"} 1048576.0
vllm:kvwire_load_errors_total{engine="0"} 2.0
vllm:kvwire_tier1_promoted_blocks_total{engine="0"} 8.0
vllm:kvwire_tier1_bytes_saved_total{engine="0"} 2097152.0
vllm:kvwire_CPUOffloadConnector_blocks_loaded_total{engine="0"} 5.0
vllm:kvwire_SharedStorageConnector_blocks_loaded_total{engine="0"} 7.0
vllm:kvwire_SharedStorageConnector_lookup_hit_blocks_total{engine="0"} 12.0
"""


def test_a_tiered_connector_s_counters_split_by_tier_its_secondary_s_hits_brought_in() -> None:
    counters = serve.counters_of(METRICS)

    by_tier = bench.tier_counters(counters, "tiered")

    assert by_tier["CPU"] == {
        "lookup_hit_blocks": 22.0,
        "blocks_loaded": 20.0,
        "bytes_saved": 1048576.0,
        "load_errors": 2.0,
    }
    assert by_tier["disk"] == {"promoted_blocks": 8.0, "bytes_saved": 2097152.0}
    # Every block loaded passes through the pool: the pool's own are those the disk did not give.
    assert bench.tier_hits("tiered", by_tier) == [12.0, 8.0]


def test_a_multi_connector_s_hits_are_what_each_child_loaded() -> None:
    by_tier = bench.tier_counters(serve.counters_of(METRICS), "multi")

    assert by_tier["CPU"] == {"blocks_loaded": 5.0}
    assert bench.tier_hits("multi", by_tier) == [5.0, 7.0]


def a_row(kind: str, throughput: float, computed: float, texts: list[str]) -> dict[str, Any]:
    client = dict.fromkeys(serve.CLIENT_FIGURES, 1.0)
    client.update(request_throughput=throughput, output_throughput=2 * throughput)
    client["mean_ttft_ms"] = 100 / throughput
    return {
        "kind": kind,
        "status": "ok",
        "client": client,
        "first_errors": [],
        "generated_texts": texts,
        "server": serve.counters_of(METRICS) | {"prompt_tokens_local_compute": computed},
        "log_warnings": [],
        "wall_seconds": 1.0,
    }


def a_round(limit_throughput: float, tiered_throughput: float) -> dict[str, Any]:
    return {
        bench.LIMIT: a_row("limit", limit_throughput, 1000.0, ["a", "b"]),
        bench.NO_CONNECTOR: a_row("none", 2.0, 3000.0, ["a", "b"]),
        "tiered: lru spill, save_threshold 1": a_row(
            "tiered", tiered_throughput, 1500.0, ["a", "c"]
        ),
        "tiered: arc spill, save_threshold 1": {
            "kind": "tiered",
            "status": "failed",
            "reason": "ValueError: tiers[0]: no such medium",
            "error": "...",
        },
    }


def summary() -> dict[str, Any]:
    # The limit is slower in the second round, the tiered row with it: the same ratio.
    rounds = [a_round(4.0, 3.0), a_round(2.0, 1.5)]
    rounds[1]["tiered: lru spill, save_threshold 1"]["server"]["prompt_tokens_local_compute"] = (
        1600.0
    )
    return summarized(rounds)


def summarized(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds summarized over a trace of two requests of blocks a and b."""
    trace = [blocks("ab"), blocks("ab")]
    facts = bench.trace_facts(trace, 2, 5) | bench.server_sizes(bench.QUICK, trace, 10)
    return bench.summarize(bench.QUICK, facts, rounds)


def test_each_row_is_set_against_the_limit_and_the_pool_against_belady() -> None:
    rows = summary()["configurations"]

    tiered = rows["tiered: lru spill, save_threshold 1"]
    # Each round against its own round's limit.
    assert tiered["request_throughput_vs_limit"] == {
        "median": 0.75,
        "min": 0.75,
        "max": 0.75,
        "rounds": 2,
    }
    assert tiered["output_throughput_vs_limit"]["median"] == 0.75
    assert tiered["mean_ttft_vs_limit"]["median"] == pytest.approx(4 / 3, abs=1e-3)
    assert tiered["client_spread"]["request_throughput"]["min"] == 1.5
    assert [entry["client"]["request_throughput"] for entry in tiered["rounds"]] == [3.0, 1.5]
    assert tiered["outputs_equal_limit"] == "1/2"
    assert tiered["checks"]["outputs_equal_limit"]["same"]
    assert tiered["checks"]["computed_prompt_tokens"] == {
        "same": False,
        "rounds": [1500.0, 1600.0],
    }
    assert tiered["computed_prompt_tokens"] == 1500.0
    assert tiered["loaded_tokens"] == 640.0
    assert tiered["hit_blocks"] == {"CPU": 12.0, "disk": 8.0}
    assert tiered["load_error_blocks"] == 2.0
    # 4 blocks asked for, 1 of them Belady's hits with a 2-block pool.
    assert tiered["primary_hit_rate"] == 12.0 / 4
    assert tiered["primary_of_belady"] == pytest.approx(12.0 / 4 / 0.5)
    assert "generated_texts" not in tiered
    assert "primary_hit_rate" not in rows[bench.NO_CONNECTOR]
    assert rows["tiered: arc spill, save_threshold 1"]["status"] == "failed"
    assert len(rows["tiered: arc spill, save_threshold 1"]["rounds"]) == 2


def test_each_row_is_set_against_no_connector_in_its_own_round() -> None:
    summarized_rounds = summarized([a_round(4.0, 3.0), a_round(4.0, 1.5)])
    rows = summarized_rounds["configurations"]

    tiered = rows["tiered: lru spill, save_threshold 1"]
    # No connector served 2.0 req/s in each round: 1.5 and 0.75 of it.
    assert tiered["request_throughput_vs_no_connector"] == {
        "median": 1.125,
        "min": 0.75,
        "max": 1.5,
        "rounds": 2,
    }
    assert tiered["rounds_faster_than_no_connector"] == 1
    assert rows[bench.NO_CONNECTOR]["request_throughput_vs_no_connector"] is None
    row = next(
        line
        for line in bench.table(summarized_rounds).splitlines()
        if line.startswith("| tiered: lru spill")
    )
    assert "| 1.12 (0.75-1.50), 1 of 2 |" in row
    headline = bench.headline(summarized_rounds)
    assert headline["tiered: lru spill, save_threshold 1"]["rounds_faster_than_no_connector"] == 1


def test_the_table_has_a_row_per_configuration_failures_with_their_reason() -> None:
    text = bench.table(summary())

    lines = text.splitlines()
    assert "| tiered: arc spill, save_threshold 1 | failed: ValueError: tiers[0]" in text
    header = next(line for line in lines if line.startswith("| configuration"))
    row = next(line for line in lines if line.startswith("| tiered: lru spill"))
    assert row.count("|") == header.count("|")
    assert "| 2.25 (1.50-3.00) | 0.75 (0.75-0.75) |" in row
    assert "| 1500 / 1600 (differ) |" in row
    assert "| 12 / 8 |" in row
    assert bench.headline(summary())["tiered: arc spill, save_threshold 1"] == {"status": "failed"}


def test_the_plot_is_drawn_without_the_failed_rows(tmp_path: pathlib.Path) -> None:
    bench.plot(summary(), tmp_path / "serve-tiers.png")

    assert (tmp_path / "serve-tiers.png").stat().st_size > 0


def test_the_best_row_takes_the_threshold_1_tiered_row_whose_pool_hit_most() -> None:
    def tiered(eviction: str, pool_hits: float, computed: float) -> dict[str, Any]:
        row = a_row("tiered", 1.0, computed, [])
        # The lookups count both tiers' blocks; the disk's are those it brought in.
        row["server"] = {
            "kvwire_blocks_loaded": pool_hits + 10,
            "kvwire_tier1_promoted_blocks": 10.0,
            "prompt_tokens_local_compute": computed,
        }
        return row | {"eviction": eviction, "write_policy": "spill", "save_threshold": 1}

    rows = {
        "lru": tiered("lru", 50.0, 800.0),
        "arc": tiered("arc", 70.0, 900.0),
        "s3fifo": tiered("s3fifo", 70.0, 850.0),
        "arc, 2": tiered("arc", 90.0, 700.0) | {"save_threshold": 2},
        "none": a_row("none", 1.0, 100.0, []),
    }

    assert bench.best_of(rows) == ("s3fifo", "spill")
    assert bench.best_of({"none": rows["none"]}) is None


def test_a_failed_server_is_reported_by_the_error_its_log_gives_first() -> None:
    log = "\n".join(
        [
            "(APIServer pid=1) WARNING 12-03 [utils.py:1] ulimit: OSError: [Errno 24] maybe",
            "(Worker pid=2) ERROR 12-03 [executor.py:9]     raise ValueError(",
            "(Worker pid=2) ERROR 12-03 [executor.py:9] ValueError: No common block size",
            "RuntimeError: Engine core initialization failed.",
        ]
    )

    assert bench.root_cause(log) == "ValueError: No common block size"
    assert bench.root_cause("RuntimeError: the client exited\nmore") == (
        "RuntimeError: the client exited"
    )


def test_warnings_logged_while_serving_are_counted_alike_when_only_numbers_differ() -> None:
    log = "\n".join(
        [
            "(EngineCore pid=3) WARNING 12-03 12:00:01 [core.py:5] Recovered: 640 tokens",
            "(EngineCore pid=3) INFO 12-03 12:00:02 [core.py:6] fine",
            "(EngineCore pid=3) WARNING 12-03 12:00:03 [core.py:5] Recovered: 320 tokens",
        ]
    )

    assert bench.log_warnings(log) == ["Recovered: 640 tokens (x2)"]
