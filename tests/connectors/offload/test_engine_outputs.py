"""Through the engine: outputs with each connector equal outputs without one."""

from __future__ import annotations

import pathlib

import pytest

from kvwire.config import EngineConfig
from kvwire.engine.engine import LLMEngine
from tests.support.engines import (
    generate,
    renamed,
    served,
    shared_storage,
    tiered_disk,
    tiny_config,
    tokens,
    with_connector,
    workload,
)


def entry_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    return tokens(generate(tiny_config(), workload()))


def warm_in_one_engine(config: EngineConfig) -> tuple[list, list]:
    """Run the workload twice in one engine, with the local prefix cache emptied between."""
    with LLMEngine(config) as engine:
        cold = engine.generate(workload())
        engine.reset_prefix_cache()
        warm = engine.generate(renamed(workload(), "-warm"))
    return cold, warm


@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_cpu_offload_serves_a_warm_run_with_identical_outputs(reference, async_load):
    config = with_connector(
        tiny_config(),
        "CPUOffloadConnector",
        {"cpu_pool_bytes": "8MiB", "async_load": async_load},
    )
    cold, warm = warm_in_one_engine(config)
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    assert served(warm) > 0


@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_shared_storage_serves_a_second_engine_with_identical_outputs(
    reference, tmp_path: pathlib.Path, async_load
):
    config = shared_storage(tiny_config(), tmp_path, async_load=async_load)
    cold = generate(config, workload())
    warm = generate(config, workload())
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    assert served(warm) > 0


def test_the_tiered_profile_serves_from_disk_then_from_memory(reference, tmp_path: pathlib.Path):
    config = tiered_disk(tiny_config(), tmp_path)
    generate(config, workload())  # fills the disk tier
    with LLMEngine(config) as engine:
        from_disk = engine.generate(workload())
        engine.reset_prefix_cache()
        from_memory = engine.generate(renamed(workload(), "-again"))
        stats = engine.connector_stats.reduce()
    assert tokens(from_disk) == reference
    assert tokens(from_memory) == reference
    assert stats["SharedStorageConnector"]["blocks_loaded"] > 0
    assert stats["CPUOffloadConnector"]["blocks_loaded"] > 0


@pytest.mark.slow
def test_a_worker_in_another_process_gets_pickled_plans(reference, tmp_path: pathlib.Path):
    config = shared_storage(tiny_config(), tmp_path)
    generate(config, workload())
    warm = generate(config, workload(), worker_mode="process")
    assert tokens(warm) == reference
    assert served(warm) > 0


def test_a_flipped_byte_is_recomputed_and_outputs_stay_identical(reference, tmp_path: pathlib.Path):
    config = shared_storage(tiny_config(), tmp_path)
    generate(config, workload())
    for path in entry_files(tmp_path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    warm = generate(config, workload())
    assert tokens(warm) == reference
    assert sum(output.num_load_failures for output in warm) > 0


def test_a_flipped_byte_fails_the_request_under_the_fail_policy(tmp_path: pathlib.Path):
    config = shared_storage(tiny_config(), tmp_path)
    generate(config, workload())
    for path in entry_files(tmp_path):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x80
        path.write_bytes(bytes(data))
    failing = with_connector(
        tiny_config(),
        "SharedStorageConnector",
        {"shared_storage_path": str(tmp_path)},
        policy="fail",
    )
    outputs = generate(failing, workload())
    assert any(output.error and "kv_load_failure_policy" in output.error for output in outputs)


def test_a_vanished_directory_never_reaches_the_engine(reference, tmp_path: pathlib.Path):
    import shutil

    directory = tmp_path / "store"
    config = shared_storage(tiny_config(), directory)
    with LLMEngine(config) as engine:
        shutil.rmtree(directory)
        outputs = engine.generate(workload())
        stats = engine.connector_stats.reduce()
    assert tokens(outputs) == reference
    assert stats["save_errors"] > 0


def test_a_producer_engine_and_a_consumer_engine_share_a_directory(
    reference, tmp_path: pathlib.Path
):
    extra = {"shared_storage_path": str(tmp_path), "max_save_bytes_in_flight": "4MiB"}
    producer = with_connector(tiny_config(), "SharedStorageConnector", extra, kv_role="kv_producer")
    consumer = with_connector(tiny_config(), "SharedStorageConnector", extra, kv_role="kv_consumer")
    produced = generate(producer, workload())
    consumed = generate(consumer, workload())
    assert served(produced) == 0
    assert tokens(consumed) == reference
    assert served(consumed) > 0
    before = entry_files(tmp_path)
    generate(consumer, workload(seed=9))
    assert entry_files(tmp_path) == before  # a consumer never writes


@pytest.mark.parametrize("connector", ["CPUOffloadConnector", "SharedStorageConnector"])
def test_outputs_stay_identical_when_the_engine_preempts(connector, tmp_path: pathlib.Path):
    # So few blocks that running requests are preempted and resumed.
    small = tiny_config(num_gpu_blocks=24)
    requests = workload(num_requests=8, prompt_len=30)
    expected = tokens(generate(small, requests))
    extra = (
        {"cpu_pool_bytes": "8MiB"}
        if connector == "CPUOffloadConnector"
        else {"shared_storage_path": str(tmp_path), "max_save_bytes_in_flight": "4MiB"}
    )
    config = with_connector(small, connector, extra)
    with LLMEngine(config) as engine:
        cold = engine.generate(requests)
        engine.reset_prefix_cache()
        warm = engine.generate(renamed(requests, "-warm"))
    assert sum(output.num_preemptions for output in cold + warm) > 0
    assert tokens(cold) == expected
    assert tokens(warm) == expected
