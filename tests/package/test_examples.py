"""Every example under ``examples/`` runs, as its README says it does."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
EXTERNAL = EXAMPLES / "external_connector"
KVWIRE = [sys.executable, "-m", "kvwire"]


def run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )


@pytest.mark.slow
@pytest.mark.torch
def test_the_wired_app_runs_scheduler_and_worker_in_separate_processes(
    tmp_path: pathlib.Path,
) -> None:
    result = run(
        [sys.executable, str(EXAMPLES / "wired_app" / "app.py"), "--workdir", str(tmp_path)]
    )

    assert result.returncode == 0, result.stdout + result.stderr
    first, second = result.stdout.splitlines()
    assert "role SCHEDULER" in first and "role WORKER" in first
    assert second == "4 files saved by the worker match its KV cache byte for byte"
    assert sorted(path.name for path in (tmp_path / "journal").iterdir()) == [
        "request-a",
        "request-b",
    ]


@pytest.mark.slow
@pytest.mark.torch
def test_the_override_example_passes_as_a_users_test_suite() -> None:
    result = run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(EXAMPLES / "testing_with_overrides"),
        ]
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 passed" in result.stdout


def read_example_project() -> tuple[str, str, list[tuple[str, str]]]:
    """Name, version and kvwire entry points of the example's pyproject.toml.

    Read line by line (tomllib needs Python 3.11; kvwire supports 3.10): the
    file keeps to plain ``key = "value"`` lines.
    """
    table, values, entry_points = "", {}, []
    for line in (EXTERNAL / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            table = line.strip()
        elif " = " in line and not line.startswith("#"):
            key, _, value = line.partition(" = ")
            if table == "[project]":
                values[key.strip()] = value.strip().strip('"')
            elif table == '[project.entry-points."kvwire.connectors"]':
                entry_points.append((key.strip(), value.strip().strip('"')))
    return values["name"], values["version"], entry_points


@pytest.fixture
def installed_plugin_env(tmp_path: pathlib.Path) -> dict[str, str]:
    """The environment of a process in which the example package looks pip-installed.

    Its metadata (a ``.dist-info`` with the entry points of its pyproject) and
    its sources go on ``PYTHONPATH``; the shared virtual environment is untouched.
    """
    name, version, entry_points = read_example_project()
    dist_info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    lines = ["[kvwire.connectors]"] + [f"{key} = {target}" for key, target in entry_points]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(EXTERNAL / "src")])}


def test_the_external_connector_is_found_by_its_entry_point(
    installed_plugin_env: dict[str, str],
) -> None:
    result = run([*KVWIRE, "check", str(EXTERNAL / "by-entry-point.yaml")], installed_plugin_env)

    assert result.returncode == 0, result.stderr
    assert (
        "connector: ByteCounterConnector -> kvwire_byte_counter.connector:ByteCounterConnector "
        "(entry point of distribution 'kvwire-byte-counter 0.1.0')"
    ) in result.stdout.splitlines()


def test_the_external_connector_is_found_by_module_path() -> None:
    env = {**os.environ, "PYTHONPATH": str(EXTERNAL / "src")}

    result = run([*KVWIRE, "check", str(EXTERNAL / "by-module-path.yaml")], env)

    assert result.returncode == 0, result.stderr
    assert "(module path kvwire_byte_counter.connector, which wins over the registry)" in (
        result.stdout
    )


def test_the_external_connector_is_listed_beside_the_built_ins(
    installed_plugin_env: dict[str, str],
) -> None:
    result = run([*KVWIRE, "connectors"], installed_plugin_env)

    assert result.returncode == 0, result.stderr
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("ByteCounter")]
    assert row.split("  ")[-1] == "kvwire_byte_counter.connector:ByteCounterConnector"
    assert "entry point ('kvwire-byte-counter 0.1.0')" in row


@pytest.mark.slow
@pytest.mark.torch
def test_the_external_connector_moves_through_the_container_by_entry_point(
    installed_plugin_env: dict[str, str],
) -> None:
    script = (
        "import torch\n"
        "from kvwire.container import container_for_profile\n"
        "from kvwire.interface.base import KVConnectorRole\n"
        "from kvwire.config.kv_cache import build_full_attention_kv_cache_config\n"
        "cache = build_full_attention_kv_cache_config(num_layers=1, num_blocks=4, block_size=2,"
        " num_kv_heads=1, head_size=4, dtype='float32')\n"
        f"container = container_for_profile({str(EXTERNAL / 'by-entry-point.yaml')!r},"
        " role=KVConnectorRole.WORKER, kv_cache_config=cache)\n"
        "connector = container.connector()\n"
        "connector.save_kv_layer('layers.0.attn', torch.zeros(2, 4, 2, 1, 4), None)\n"
        "print(type(connector).__module__, connector.get_kv_connector_stats().data)\n"
        "container.shutdown_resources()\n"
    )

    result = run([sys.executable, "-c", script], installed_plugin_env)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "kvwire_byte_counter.connector {'saved_bytes': {'layers.0.attn': 256}}"
    )
