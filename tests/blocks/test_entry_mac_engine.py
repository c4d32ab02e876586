"""Through the engine: forged entries change outputs without a MAC key; with one, recomputed."""

from __future__ import annotations

import pathlib

import pytest

from kvwire.engine.engine import LLMEngine
from tests.support.engines import (
    generate,
    served,
    shared_storage,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.entries import forge

VARIABLE = "KVWIRE_TEST_MAC_KEY"
KEY = "0123456789abcdef" * 4


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    return tokens(generate(tiny_config(), workload()))


@pytest.fixture
def mac_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(VARIABLE, KEY)
    return VARIABLE


def entry_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def forge_every_entry(root: pathlib.Path, unseal: bool = False) -> int:
    files = entry_files(root)
    for path in files:
        path.write_bytes(forge(path.read_bytes(), unseal))
    return len(files)


def test_without_a_mac_key_forged_entries_change_the_outputs(reference, tmp_path: pathlib.Path):
    config = shared_storage(tiny_config(), tmp_path)
    generate(config, workload())
    assert forge_every_entry(tmp_path) > 0
    warm = generate(config, workload())
    # The threat: every forged entry passed its checksum and went into the cache.
    assert sum(output.num_load_failures for output in warm) == 0
    assert served(warm) > 0
    assert tokens(warm) != reference


def test_with_a_mac_key_sealed_entries_serve_identical_outputs(
    reference, tmp_path: pathlib.Path, mac_key: str
):
    config = shared_storage(tiny_config(), tmp_path, mac_key_env=mac_key)
    generate(config, workload())
    warm = generate(config, workload())
    assert tokens(warm) == reference
    assert served(warm) > 0


@pytest.mark.parametrize("unseal", [False, True], ids=["wrong-mac", "written-without-mac"])
def test_with_a_mac_key_forged_entries_are_recomputed_and_outputs_stay_identical(
    reference, tmp_path: pathlib.Path, mac_key: str, unseal: bool
):
    config = shared_storage(tiny_config(), tmp_path, mac_key_env=mac_key)
    generate(config, workload())
    forged = forge_every_entry(tmp_path, unseal)
    with LLMEngine(config) as engine:
        warm = engine.generate(workload())
        stats = engine.connector_stats.reduce()
    assert tokens(warm) == reference
    assert sum(output.num_load_failures for output in warm) > 0
    assert 0 < stats["corrupt_entries"] <= forged


def test_the_tiered_profile_recomputes_forged_disk_entries_with_a_mac_key(
    reference, tmp_path: pathlib.Path, mac_key: str
):
    children = [
        {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_extra_config": {"cpu_pool_bytes": "8MiB"},
        },
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {
                "shared_storage_path": str(tmp_path),
                "mac_key_env": mac_key,
            },
        },
    ]
    config = with_connector(tiny_config(), "MultiConnector", {"connectors": children})
    generate(config, workload())  # fills the disk tier
    forge_every_entry(tmp_path)
    with LLMEngine(config) as engine:
        warm = engine.generate(workload())
        stats = engine.connector_stats.reduce()
    assert tokens(warm) == reference
    assert stats["SharedStorageConnector"]["corrupt_entries"] > 0


@pytest.mark.slow
def test_a_worker_in_another_process_reads_the_key_from_its_environment(
    reference, tmp_path: pathlib.Path, mac_key: str
):
    config = shared_storage(tiny_config(), tmp_path, mac_key_env=mac_key)
    generate(config, workload())
    warm = generate(config, workload(), worker_mode="process")
    assert tokens(warm) == reference
    assert served(warm) > 0
    assert sum(output.num_load_failures for output in warm) == 0
