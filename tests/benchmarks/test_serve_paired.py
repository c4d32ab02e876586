"""The paired serving benchmark's pairing and arithmetic; its servers run only in the benchmark."""

from __future__ import annotations

import pathlib

import pytest

from benchmarks import rounds, serve_paired, serve_tiers


def test_the_server_that_gets_a_request_first_alternates() -> None:
    assert [serve_paired.order(index) for index in range(4)] == [(0, 1), (1, 0), (0, 1), (1, 0)]


def test_the_server_that_starts_first_alternates_from_pass_to_pass() -> None:
    assert [serve_paired.start_order(index) for index in range(3)] == [(0, 1), (1, 0), (0, 1)]


def test_a_pass_sets_the_first_s_throughput_over_the_second_s_on_the_trace_and_each_half() -> None:
    first = [0.1, 0.1, 0.2, 0.2]
    second = [0.1, 0.1, 0.1, 0.1]

    figures = serve_paired.pass_figures([first, second], [["a", "b", "c", "d"], list("abxd")])

    assert figures["request_throughput"] == [6.667, 10.0]
    # The first took 0.6 s where the second took 0.4: it served 0.667 of the second's req/s.
    assert figures["first_over_second"] == pytest.approx(0.667)
    assert figures["first_over_second_by_half"] == [1.0, 0.5]
    assert figures["outputs_equal"] == 3


def test_each_kind_is_the_serve_tiers_configuration_its_quick_run_serves() -> None:
    tiered = serve_paired.configuration("tiered")

    assert tiered.quick and tiered.kind == "tiered"
    assert tiered in serve_tiers.CONFIGURATIONS
    with pytest.raises(ValueError, match="'disk' is not a kind nor a configuration's label"):
        serve_paired.configuration("disk")


def test_the_tiered_kind_runs_the_tiered_disk_profile_s_policies() -> None:
    tiered = serve_paired.configuration("tiered")
    shipped = serve_tiers.shipped_profile("tiered-disk")["kv_transfer_config"]
    options = shipped["kv_connector_extra_config"]

    assert (tiered.eviction, tiered.write_policy) == (options["eviction"], options["write_policy"])
    assert (tiered.save_threshold, tiered.write_around) == (
        options.get("save_threshold", 1),
        options.get("write_around", False),
    )
    assert tiered.promotion == options.get("promotion", "always")


def test_a_configuration_is_named_by_its_label_with_its_settings() -> None:
    direct = serve_paired.configuration("tiered-kvfifo-spill-promotion-never")

    assert (direct.kind, direct.eviction, direct.write_policy, direct.promotion) == (
        "tiered",
        "kvfifo",
        "spill",
        "never",
    )
    assert serve_paired.configuration("tiered-kvfifo-spill-threshold-2-write-around") == (
        serve_paired.configuration("tiered")
    )
    # The best row is picked in a serve-tiers run; a pass has none to pick from.
    assert not any("best" in name for name in serve_paired.PAIRED_NAMES)
    options = serve_tiers.transfer_config(direct, pathlib.Path("/s"), 64)
    assert options is not None
    tiered_options = options["kv_connector_extra_config"]["kvwire"]["kv_transfer_config"]
    assert tiered_options["kv_connector_extra_config"]["promotion"] == "never"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tiered", "disk"], "argument CONFIGURATION: invalid choice: 'disk'"),
        (["tiered"], "the following arguments are required"),
        (["tiered", "none", "--passes", "0"], "argument --passes: expected a whole number"),
    ],
)
def test_the_command_line_refuses_a_pair_it_cannot_run(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        serve_paired.main(argv)

    assert message in capsys.readouterr().err


def test_the_table_gives_every_pass_and_the_median_with_its_range() -> None:
    passes = [
        {
            "request_throughput": [9.41, 10.15],
            "first_over_second": ratio,
            "first_over_second_by_half": [ratio, ratio],
            "outputs_equal": 100,
            "computed_prompt_tokens": [27684, 26564],
            "idle_busy_share": 0.017,
        }
        for ratio in (0.926, 0.957, 0.94)
    ]
    summary = {
        "configurations": ["tiered", "shared storage"],
        "workload": {"trace": {"requests": 100}},
        "passes": passes,
        "first_over_second": rounds.spread([p["first_over_second"] for p in passes]),
    }

    table = serve_paired.table(summary)

    assert "| 2 | 9.41 / 10.15 | 0.957 | 0.957, 0.957 | 100 | 27,684 / 26,564 | 0.017 |" in table
    assert "| median (range) | | 0.940 (0.926-0.957) | | | | |" in table


def test_outside_the_vllm_venv_it_says_where_it_runs(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve_paired.importlib.util, "find_spec", lambda name: None)

    with pytest.raises(SystemExit, match="runs in the vLLM venv"):
        serve_paired.run(tmp_path, ["tiered", "none"], quick=True, passes=1)
    assert not list(tmp_path.iterdir())


def test_redis_configurations_pair_by_label_each_under_a_key_prefix_of_its_own() -> None:
    alone = serve_paired.configuration("redis")
    tiered = serve_paired.configuration("tiered-kvfifo-spill-redis")

    assert serve_tiers.needs_redis(alone) and serve_tiers.needs_redis(tiered)
    assert not serve_tiers.needs_redis(serve_paired.configuration("tiered"))
    with pytest.raises(ValueError, match="keeps blocks in Redis, and no redis_url was given"):
        serve_tiers.transfer_config(alone, pathlib.Path("/s"), 64)
    url = "redis://127.0.0.1:6399/0"
    prefixes = []
    for config, path in ((alone, "/s1"), (tiered, "/s1"), (tiered, "/s2")):
        transfer = serve_tiers.transfer_config(config, pathlib.Path(path), 64, url)
        assert transfer is not None
        options = transfer["kv_connector_extra_config"]["kvwire"]["kv_transfer_config"][
            "kv_connector_extra_config"
        ]
        store = options["tiers"][0] if config.kind == "tiered" else options
        assert store["url"] == url
        prefixes.append(store["key_prefix"])
    # Two servers of a pass, and two passes, never read each other's entries.
    assert len(set(prefixes)) == 3


def test_cold_disk_configurations_keep_every_entry_out_of_the_page_cache() -> None:
    alone = serve_paired.configuration("shared-storage-page-cache-drop")
    tiered = serve_paired.configuration(
        "tiered-kvfifo-spill-threshold-2-write-around-page-cache-drop"
    )

    assert (alone.kind, alone.page_cache) == ("shared-storage", "drop")
    assert (tiered.save_threshold, tiered.write_around, tiered.page_cache) == (2, True, "drop")
    stores = []
    for config in (alone, tiered, serve_paired.configuration("shared-storage")):
        transfer = serve_tiers.transfer_config(config, pathlib.Path("/s"), 64)
        assert transfer is not None
        options = transfer["kv_connector_extra_config"]["kvwire"]["kv_transfer_config"][
            "kv_connector_extra_config"
        ]
        stores.append(options["tiers"][0] if config.kind == "tiered" else options)
    assert [store["page_cache"] for store in stores] == ["drop", "drop", "keep"]
    # Each in a directory of its own.
    assert len({store["shared_storage_path"] for store in stores}) == 3


def test_limit_cache_configurations_run_on_the_limit_s_vllm_cache_the_rest_on_the_small_one(
    tmp_path: pathlib.Path,
) -> None:
    sizes = {"max_model_len": 400, "vllm_cache_blocks": 48, "limit_cache_blocks": 1000}
    tiered = serve_paired.configuration("tiered-kvfifo-spill-threshold-2-write-around-limit-cache")
    alone = serve_paired.configuration("shared-storage-limit-cache")

    def cache_blocks(config: serve_tiers.Configuration) -> int:
        spec = serve_tiers.server_spec("m", config, sizes, None, tmp_path / "log")
        memory = int(spec.args[spec.args.index("--kv-cache-memory-bytes") + 1])
        return memory // serve_tiers.BLOCK_BYTES

    assert (tiered.save_threshold, tiered.write_around, tiered.vllm_cache) == (2, True, "limit")
    assert (alone.kind, alone.vllm_cache) == ("shared-storage", "limit")
    pool = serve_paired.configuration("cpu-limit-cache")
    assert cache_blocks(tiered) == cache_blocks(alone) == cache_blocks(pool) == 1000
    assert cache_blocks(serve_paired.configuration("tiered")) == 48
    assert cache_blocks(serve_paired.configuration("limit")) == 1000


def test_a_full_run_of_a_pair_is_written_beside_its_quick_run() -> None:
    assert serve_paired.result_stem(["tiered", "limit"], quick=True) == "serve-paired-tiered-limit"
    assert serve_paired.result_stem(["tiered", "limit"], quick=False) == (
        "serve-paired-full-tiered-limit"
    )
