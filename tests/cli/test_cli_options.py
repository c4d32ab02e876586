"""`kvwire --version`, `--log-level` before or after the command, and `kvwire profiles`."""

from __future__ import annotations

import io
import pathlib
import subprocess
import sys

import pytest
import yaml

import kvwire
from kvwire.cli import build_parser, list_profiles, main
from kvwire.config.profile import shipped_profile_names, shipped_profile_path


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])

    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvwire {kvwire.__version__}\n"


@pytest.mark.parametrize(
    "arguments",
    [
        ["--log-level", "INFO", "check", "cpu-offload"],
        ["check", "--log-level", "INFO", "cpu-offload"],
        ["check", "cpu-offload", "--log-level", "INFO"],
        ["check", "cpu-offload", "--log-level=INFO"],
        ["profiles", "--log-level", "INFO"],
        ["connectors", "--log-level", "INFO"],
        ["--log-level", "ERROR", "check", "cpu-offload", "--log-level", "INFO"],
    ],
)
def test_the_log_level_is_taken_before_or_after_the_command(arguments: list[str]) -> None:
    assert build_parser().parse_args(arguments).log_level == "INFO"


def test_the_log_level_defaults_to_warning_wherever_it_could_go() -> None:
    assert build_parser().parse_args(["check", "cpu-offload"]).log_level == "WARNING"


def test_the_run_command_takes_the_log_level_after_it() -> None:
    args = build_parser(wants_run=True).parse_args(["run", "cpu-offload", "--log-level", "DEBUG"])

    assert args.log_level == "DEBUG" and args.profile == "cpu-offload"


@pytest.mark.torch  # checking a built-in connector imports it
def test_a_log_level_after_the_command_reaches_the_loggers(tmp_path: pathlib.Path) -> None:
    # In a process of its own: pytest's handlers would make logging.basicConfig a no-op here.
    result = subprocess.run(
        [sys.executable, "-m", "kvwire", "check", "cpu-offload", "--log-level", "INFO"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    assert "INFO kvwire.hma: HMA gate:" in result.stderr


def test_a_wrong_log_level_after_the_command_names_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "cpu-offload", "--log-level", "LOUD"])

    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --log-level: invalid choice: 'LOUD' (choose from " in err
    assert all(level in err for level in ("DEBUG", "INFO", "WARNING", "ERROR"))


def test_profiles_lists_every_shipped_name_with_its_connector() -> None:
    out = io.StringIO()

    assert list_profiles(out=out) == 0

    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["NAME", "CONNECTOR", "WHAT", "IT", "IS"]
    rows = {
        line.split()[0]: line.split()[1] for line in lines[1 : 1 + len(shipped_profile_names())]
    }
    assert list(rows) == shipped_profile_names()
    assert rows["cpu-offload"] == "CPUOffloadConnector"
    assert rows["tiered-disk"] == "TieredOffloadConnector"
    assert lines[-1] == (
        f"files: {shipped_profile_path('cpu-offload').parent}; "
        "copy one (kvwire profiles --show NAME) to edit it"
    )
    # Each description whole: the first sentence of the profile's opening comment.
    assert not any(line.endswith("...") for line in lines)
    assert lines[1].endswith(
        "KV blocks offloaded to a preallocated CPU memory pool and loaded back when a prompt "
        "shares a prefix with an earlier one"
    )


def test_profiles_show_prints_the_profile_to_copy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "--show", "redis"]) == 0

    shown = capsys.readouterr().out
    assert shown == shipped_profile_path("redis").read_text()
    assert yaml.safe_load(shown)["kv_transfer_config"]["kv_connector"] == "RedisConnector"


def test_profiles_show_of_an_unknown_name_lists_the_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["profiles", "--show", "reddis"]) == 1

    err = capsys.readouterr().err
    assert err.startswith("kvwire profiles: --show: error: invalid profile reddis (1 problem):")
    assert "no shipped profile is named 'reddis' (did you mean 'redis'?)" in err


@pytest.mark.torch
def test_check_takes_a_shipped_name_from_any_folder(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)

    assert main(["check", "shared-storage"]) == 0

    assert capsys.readouterr().out.startswith("profile shared-storage: valid\n")


def test_check_of_an_unknown_name_says_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "shared-storge"]) == 1

    err = capsys.readouterr().err
    assert err.startswith("kvwire check: shared-storge: error: invalid profile shared-storge")
    assert "(did you mean 'shared-storage'?)" in err
