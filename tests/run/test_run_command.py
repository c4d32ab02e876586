"""``kvwire run``: four passes, a table or JSON, and clear errors."""

from __future__ import annotations

import io
import json
import pathlib
import re
import sys

import pytest
import yaml

from kvwire import cli
from kvwire.config.profile import shipped_profile_path

SMALL_WORKLOAD = ["--requests", "4", "--prompt-len", "24", "--output-len", "3", "--no-progress"]


def _directory_profile(tmp_path: pathlib.Path) -> pathlib.Path:
    profile = {
        "model_config": {"num_layers": 2, "vocab_size": 300},
        "cache_config": {"block_size": 4, "num_gpu_blocks": 64},
        "kv_transfer_config": {
            "kv_connector": "DirectoryConnector",
            "kv_connector_module_path": "tests.support.directory_connectors",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"store_dir": str(tmp_path / "store")},
        },
    }
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def test_json_report_has_four_passes_with_warm_hits_and_identical_outputs(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["run", str(_directory_profile(tmp_path)), *SMALL_WORKLOAD, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["ok"] is True
    passes = report["passes"]
    assert passes["no connector"]["tokens_from_connector"] == 0
    assert passes["cold"]["tokens_from_connector"] == 0
    assert passes["warm"]["tokens_from_connector"] > 0
    assert passes["local"]["tokens_from_connector"] == 0
    assert all(row["outputs_identical"] for row in passes.values())


def test_the_local_pass_finds_every_prefix_in_the_engines_own_cache_without_a_connector(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 4 prompts of 64 tokens (4 blocks of 16): each can hit its first 3 blocks.
    cli.main(["run", "cpu-offload", *SMALL_WORKLOAD, "--prompt-len", "64", "--json"])
    passes = json.loads(capsys.readouterr().out)["passes"]
    local, warm = passes["local"], passes["warm"]
    assert local["tokens_from_local_cache"] == 4 * 48
    # What the warm pass got from the connector, the local pass has locally.
    assert local["tokens_from_local_cache"] == (
        warm["tokens_from_local_cache"] + warm["tokens_from_connector"]
    )
    # No connector in that pass: no transfer figures at all.
    for key in ("bytes_saved", "bytes_loaded", "transfer_s", "effective_gb_per_s"):
        assert local[key] is None
    assert local["outputs_identical"]


def test_warm_over_local_is_the_ratio_of_their_ttft_medians(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli.main(["run", str(_directory_profile(tmp_path)), *SMALL_WORKLOAD, "--json"])
    report = json.loads(capsys.readouterr().out)
    passes = report["passes"]
    expected = passes["warm"]["ttft_p50_ms"] / passes["local"]["ttft_p50_ms"]
    assert report["warm_vs_local_ttft_p50"] == pytest.approx(expected)
    assert passes["warm"]["ttft_p50_vs_local"] == pytest.approx(expected)
    assert passes["local"]["ttft_p50_vs_local"] == pytest.approx(1.0)


def test_the_table_names_every_figure(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli.main(["run", str(_directory_profile(tmp_path)), *SMALL_WORKLOAD])
    table = capsys.readouterr().out
    for label in ("hit rate", "TTFT p50", "TTFT p95", "bytes loaded", "effective GB/s"):
        assert label in table
    header = table.splitlines()[3].split()
    assert header[-4:] == ["connector", "cold", "warm", "local"]
    assert "TTFT p50 / local" in table
    assert "warm / local TTFT p50: " in table
    # The last line says in words what the connector bought.
    last = table.strip().splitlines()[-1]
    assert re.fullmatch(
        r"With DirectoryConnector the warm pass took \d+\.\d{3} s, \d+\.\d\dx (faster|slower) "
        r"than the \d+\.\d{3} s with no connector; [1-9][\d,]* of its [\d,]+ prompt tokens were "
        r"loaded instead of computed, and every output was identical to the no-connector pass\.",
        last,
    ), last


def test_effective_throughput_is_bytes_moved_over_the_connectors_transfer_time(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli.main(["run", str(_directory_profile(tmp_path)), *SMALL_WORKLOAD, "--json"])
    warm = json.loads(capsys.readouterr().out)["passes"]["warm"]
    assert warm["bytes_loaded"] > 0 and warm["transfer_s"] > 0
    moved = warm["bytes_loaded"] + warm["bytes_saved"]
    assert warm["effective_gb_per_s"] == pytest.approx(moved / warm["transfer_s"] / 1e9)


def test_the_no_connector_pass_reports_no_transfer_figures(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli.main(["run", str(_directory_profile(tmp_path)), *SMALL_WORKLOAD, "--json"])
    baseline = json.loads(capsys.readouterr().out)["passes"]["no connector"]
    for key in ("bytes_saved", "bytes_loaded", "transfer_s", "effective_gb_per_s"):
        assert baseline[key] is None


def test_a_counter_the_connector_reports_in_one_pass_is_zero_in_a_pass_without_it(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli.main(["run", str(_directory_profile(tmp_path)), *SMALL_WORKLOAD, "--json"])
    passes = json.loads(capsys.readouterr().out)["passes"]
    assert passes["cold"]["bytes_loaded"] == 0
    assert passes["warm"]["bytes_saved"] == 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_no_progress_is_drawn_and_stdout_holds_only_the_table(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = [arg for arg in SMALL_WORKLOAD if arg != "--no-progress"]
    cli.main(["run", str(_directory_profile(tmp_path)), *workload])
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith("kvwire run: DirectoryConnector")
    assert "requests (" not in captured.out


def test_on_a_terminal_the_progress_bar_redraws_one_line_and_erases_it_at_the_end(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    workload = [arg for arg in SMALL_WORKLOAD if arg != "--no-progress"]
    cli.main(["run", str(_directory_profile(tmp_path)), *workload])
    drawn = terminal.getvalue()
    assert "\n" not in drawn
    # Four passes of 4 requests; the no-connector engine runs the local pass.
    assert "\r[" + "#" * 30 + "] 16/16 requests (warm)" in drawn
    assert "] 8/16 requests (local)" in drawn
    assert drawn.endswith("\r\x1b[K")
    assert "requests (" not in capsys.readouterr().out


def test_help_explains_every_row_of_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    help_text = capsys.readouterr().out
    for row in (
        "tokens from connector",
        "transfer time",
        "effective GB/s",
        "TTFT p50 / p95",
        "TTFT p50 / local",
    ):
        assert row in help_text
    assert "(bytes saved + bytes loaded) / transfer time" in help_text


def test_the_cpu_offload_profile_serves_the_warm_pass_prefix_from_the_connector(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 4 prompts of 64 tokens (4 blocks of 16) sharing their first 48 tokens.
    status = cli.main(["run", "cpu-offload", *SMALL_WORKLOAD, "--prompt-len", "64", "--json"])
    warm = json.loads(capsys.readouterr().out)["passes"]["warm"]
    assert status == 0
    # The first request loads the shared prefix; the three admitted with it
    # share those blocks in the engine instead of loading copies.
    assert warm["tokens_from_connector"] == 48
    assert warm["tokens_from_local_cache"] == 3 * 48


def test_prompts_come_from_a_jsonl_file(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the same long system prompt, then a question"}\n' * 3)
    profile = _directory_profile(tmp_path)
    status = cli.main(["run", str(profile), "--prompts", str(prompts), "--no-progress", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["passes"]["warm"]["requests"] == 3


def test_a_profile_without_a_connector_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "plain.yaml"
    profile.write_text("cache_config:\n  block_size: 4\n")
    assert cli.main(["run", str(profile), "--no-progress"]) == 2
    assert "kv_transfer_config.kv_connector is not set" in capsys.readouterr().err


def test_an_unknown_profile_name_is_refused_with_the_shipped_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["run", "cpu-ofload", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no shipped profile is named 'cpu-ofload' (did you mean 'cpu-offload'?)" in err
    assert "a path to a YAML file works too" in err


def test_importing_the_run_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvwire.run; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_with_no_profile_it_runs_the_embedded_default(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["run", *SMALL_WORKLOAD, "--prompt-len", "48", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0
    assert report["connector"] == "CPUOffloadConnector"
    assert report["passes"]["warm"]["tokens_from_connector"] > 0


@pytest.mark.slow
def test_a_worker_process_run_gives_identical_outputs(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = str(_directory_profile(tmp_path))
    status = cli.main(["run", profile, *SMALL_WORKLOAD, "--worker-process", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["worker_mode"] == "process"
    assert report["passes"]["warm"]["tokens_from_connector"] > 0


def test_an_unknown_preset_names_the_accepted_ones(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = str(_directory_profile(tmp_path))
    assert cli.main(["run", profile, "--preset", "huge", "--no-progress"]) == 2
    assert "preset: 'huge' is not one of tiny, bench" in capsys.readouterr().err


def test_a_shared_prefix_ratio_outside_zero_to_one_is_a_usage_error(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", str(_directory_profile(tmp_path)), "--shared-prefix-ratio", "1.5"])
    assert exit_info.value.code == 2
    assert "--shared-prefix-ratio: must be between 0 and 1, got 1.5" in capsys.readouterr().err


def test_a_connector_config_error_is_reported_without_a_traceback(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "typo.yaml"
    profile.write_text(
        "kv_transfer_config:\n  kv_connector: CPUOffloadConnectr\n  kv_role: kv_both\n"
    )
    assert cli.main(["run", str(profile), *SMALL_WORKLOAD]) == 2
    assert f"kvwire run: {profile}: error: Unsupported connector type: CPUOffloadConnectr" in (
        capsys.readouterr().err
    )


@pytest.mark.slow
def test_a_tensor_parallel_run_splits_the_heads_over_two_worker_processes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The embedded CPU-offload profile: each rank keeps its head's blocks in its own pool.
    status = cli.main(["run", *SMALL_WORKLOAD, "--prompt-len", "40", "--tensor-parallel-size", "2"])
    table = capsys.readouterr().out
    assert status == 0
    assert "(2 worker processes: tensor_parallel_size 2 x pipeline_parallel_size 1)" in table
    assert "every output was identical to the no-connector pass." in table
    warm_hits = next(
        line for line in table.splitlines() if line.startswith("tokens from connector")
    )
    assert warm_hits.split()[-2] != "0"  # the warm column


def test_a_tensor_parallel_size_that_does_not_divide_the_kv_heads_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["run", *SMALL_WORKLOAD, "--tensor-parallel-size", "3"]) == 2
    error = capsys.readouterr().err
    assert "parallel_config.tensor_parallel_size: 3 does not divide model_config.num_kv_heads" in (
        error
    )


def _shared_storage_profile(tmp_path: pathlib.Path, identity: str = "") -> pathlib.Path:
    profile = yaml.safe_load(shipped_profile_path("shared-storage").read_text())
    profile["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] = str(
        tmp_path / "store"
    )
    if identity:
        profile.setdefault("model_config", {})["identity"] = identity
    path = tmp_path / "shared-storage.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def test_each_run_starts_cold_and_leaves_the_shared_directory_as_it_found_it(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = _shared_storage_profile(tmp_path)
    for _ in range(2):
        assert cli.main(["run", str(profile), *SMALL_WORKLOAD, "--json"]) == 0
        passes = json.loads(capsys.readouterr().out)["passes"]
        assert passes["cold"]["tokens_from_connector"] == 0
        assert passes["warm"]["tokens_from_connector"] > 0
        # What the run stored went with it: the next one finds nothing.
        assert not [path for path in (tmp_path / "store").rglob("*") if path.is_file()]


def test_a_profile_that_names_its_identity_shares_entries_across_runs(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator's choice: the identity names the entries, so a second run finds them."""
    profile = _shared_storage_profile(tmp_path, identity="acme-test-model")
    cold_hits = []
    for _ in range(2):
        assert cli.main(["run", str(profile), *SMALL_WORKLOAD, "--json"]) == 0
        cold_hits.append(
            json.loads(capsys.readouterr().out)["passes"]["cold"]["tokens_from_connector"]
        )
    assert cold_hits[0] == 0 and cold_hits[1] > 0
