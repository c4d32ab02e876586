"""The profiles kvwire ships, addressed by name from any folder; a path still reads a file."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from kvwire.config.profile import (
    DEFAULT_PROFILE_NAME,
    is_profile_name,
    load_profile,
    shipped_profile_names,
    shipped_profile_path,
    unstructure_engine_config,
)
from kvwire.container import container_for_profile
from kvwire.exceptions import ProfileError

REPO = pathlib.Path(__file__).resolve().parents[2]
PROFILES_FOLDER = REPO / "src" / "kvwire" / "profiles"
# What vLLM decides when kvwire runs inside it (docs/vllm.md).
VLLM_OWNS = (
    "model_config",
    "block_size",
    "dtype",
    "kv_role",
    "engine_id",
    "kv_load_failure_policy",
)


def test_the_shipped_names_are_the_package_profiles_files() -> None:
    files = sorted(path.stem for path in PROFILES_FOLDER.glob("*.yaml"))

    assert shipped_profile_names() == files
    assert {"cpu-offload", "redis", "shared-storage", "tiered-disk"} <= set(files)


def test_the_package_declares_its_profiles_as_package_data() -> None:
    # Without it a wheel ships no profile, and every name is unknown once installed.
    assert '"profiles/*.yaml"' in (REPO / "pyproject.toml").read_text()


def test_the_default_profile_is_a_shipped_one() -> None:
    assert DEFAULT_PROFILE_NAME in shipped_profile_names()


@pytest.mark.parametrize(
    ("source", "is_name"),
    [
        ("cpu-offload", True),
        ("my_profile", True),
        ("cpu-offload.yaml", False),
        ("cpu-offload.yml", False),
        ("./cpu-offload", False),
        ("profiles/cpu-offload", False),
        ("/etc/kvwire/cpu-offload", False),
        (pathlib.Path("cpu-offload"), False),
    ],
)
def test_a_name_has_no_slash_and_no_yaml_suffix(source: str | pathlib.Path, is_name: bool) -> None:
    assert is_profile_name(source) is is_name


def test_a_name_loads_the_same_config_as_its_file_from_any_folder(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    by_name = unstructure_engine_config(load_profile("disagg-prefill"))
    by_path = unstructure_engine_config(load_profile(str(PROFILES_FOLDER / "disagg-prefill.yaml")))

    # disagg-prefill sets its engine_id: nothing differs, not even a fresh uuid.
    assert by_name == by_path


def test_container_for_profile_takes_a_name(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    container = container_for_profile("cpu-offload")

    transfer = container.engine_config().kv_transfer_config
    assert transfer is not None and transfer.kv_connector == "CPUOffloadConnector"


def test_an_unknown_name_lists_the_shipped_ones_and_says_a_path_works() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile("cpu-ofload")

    (problem,) = caught.value.problems
    assert caught.value.origin == "cpu-ofload"
    assert problem.startswith(
        "no shipped profile is named 'cpu-ofload' (did you mean 'cpu-offload'?); "
        f"the shipped profiles are {', '.join(shipped_profile_names())}"
    )
    assert problem.endswith(
        "a path to a YAML file works too: one with a / or ending in .yaml or .yml"
    )


def test_an_unknown_name_far_from_every_shipped_one_suggests_none() -> None:
    with pytest.raises(ProfileError) as caught:
        container_for_profile("qqqqqqqq")

    assert "did you mean" not in caught.value.problems[0]


def test_an_unknown_name_that_is_a_file_here_says_how_to_read_the_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").write_text(
        "kv_transfer_config: {kv_connector: CPUOffloadConnector, kv_role: kv_both}\n"
    )

    with pytest.raises(ProfileError) as caught:
        load_profile("mine")

    assert caught.value.problems[0].endswith(", so ./mine reads the file of that name here")
    transfer = load_profile("./mine").kv_transfer_config
    assert transfer is not None and transfer.kv_connector == "CPUOffloadConnector"


def test_a_path_ending_in_yaml_is_read_as_a_file_even_beside_a_shipped_name(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu-offload.yaml").write_text("cache_config: {block_size: 4}\n")

    assert load_profile("cpu-offload.yaml").cache_config.block_size == 4
    assert load_profile("cpu-offload").cache_config.block_size == 16


def test_a_missing_path_is_still_a_file_error() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile("absent/cpu-offload.yaml")

    assert caught.value.problems == ("cannot read the profile: No such file or directory",)


@pytest.mark.parametrize("name", shipped_profile_names())
def test_each_shipped_profile_says_what_vllm_overrides(name: str) -> None:
    header = opening_comment(shipped_profile_path(name).read_text())

    assert f'Under vLLM ("kvwire_profile": "{name}"), vLLM\'s own values replace' in header
    for field in VLLM_OWNS:
        assert field in header


@pytest.mark.parametrize("name", shipped_profile_names())
def test_each_shipped_profile_shows_its_commands_by_name(name: str) -> None:
    text = shipped_profile_path(name).read_text()

    assert f"kvwire check {name}\n" in text or f"kvwire run {name}" in text
    assert ".yaml" not in text
    assert yaml.safe_load(text)["kv_transfer_config"]["kv_connector"]


def opening_comment(text: str) -> str:
    lines = text.splitlines()
    return "\n".join(lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def test_an_installation_without_its_profiles_says_to_reinstall(tmp_path: pathlib.Path) -> None:
    # kvwire as a broken install leaves it: the package without its package data.
    site = tmp_path / "site"
    shutil.copytree(
        REPO / "src" / "kvwire",
        site / "kvwire",
        ignore=shutil.ignore_patterns("profiles", "__pycache__"),
    )
    code = "import sys, kvwire.cli; sys.exit(kvwire.cli.main(sys.argv[1:]))"

    def kvwire(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *arguments],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(site)},
            capture_output=True,
            text=True,
            timeout=60,
        )

    checked, listed = kvwire("check", "cpu-offload"), kvwire("profiles")

    assert checked.returncode == 1
    assert (
        "no shipped profile is named 'cpu-offload'; this installation of kvwire has no shipped "
        "profiles (kvwire/profiles/ is missing: reinstall kvwire); a path to a YAML file works too"
    ) in checked.stderr
    assert listed.returncode == 1
    assert listed.stderr == (
        "kvwire profiles: error: this installation of kvwire has no shipped profiles "
        "(kvwire/profiles/ is missing: reinstall kvwire)\n"
    )
