"""kvwire's pytest plugin gives a test a container whose KV cache is sized: `kvwire_container`."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
from typing import Any

import attrs

from kvwire.config.kv_cache import build_kv_cache_config
from kvwire.connectors.offload import CPUOffloadConnector
from kvwire.interface.base import KVConnectorRole

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_container_is_sized_as_the_engine_sizes_the_profile_s_model(
    kvwire_container: Any,
) -> None:
    container = kvwire_container("cpu-offload", num_blocks=64)

    config = container.engine_config()
    cache = attrs.evolve(config.cache_config, num_gpu_blocks=64)
    sized = container.kv_cache_config()
    assert sized.num_blocks == 64
    assert sized == build_kv_cache_config(attrs.evolve(config, cache_config=cache))
    worker = container.worker_connector()
    assert isinstance(worker, CPUOffloadConnector)
    assert worker.role is KVConnectorRole.WORKER


def test_what_the_fixture_built_is_shut_down_when_the_test_ends(
    tmp_path: pathlib.Path,
) -> None:
    test = tmp_path / "test_shutdown.py"
    test.write_text(
        "BUILT = []\n"
        "def test_builds(kvwire_container):\n"
        "    container = kvwire_container('cpu-offload', num_blocks=32)\n"
        "    connector = container.scheduler_connector()\n"
        "    connector.shutdown = lambda: BUILT.append('shut down')\n"
        "def test_then(kvwire_container):\n"
        "    assert BUILT == ['shut down']\n"
    )
    run_pytest(test, tmp_path)


def test_the_container_page_s_fixture_example_runs_as_a_test(tmp_path: pathlib.Path) -> None:
    text = (REPO / "docs" / "container.md").read_text()
    blocks = [
        block
        for block in re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
        if "kvwire_container(" in block
    ]
    assert len(blocks) == 1
    test = tmp_path / "test_container_page_example.py"
    test.write_text(blocks[0])
    run_pytest(test, tmp_path)


def run_pytest(test: pathlib.Path, folder: pathlib.Path) -> None:
    """Run `test` as a user's project would: pytest finds kvwire's plugin by its entry point."""
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
