"""Shared storage under real faults, with real processes: killed writers, a full disk,
a producer and a consumer on one directory at once."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.engine.engine import LLMEngine
from tests.support.engines import (
    generate,
    renamed,
    shared_storage,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.processes.store import big_block_config, count_torn_entries

ROOT = pathlib.Path(__file__).resolve().parents[3]


def store_process(directory: pathlib.Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "tests.support.processes.store", "--dir", str(directory), *args]


def entry_count(directory: pathlib.Path) -> int:
    return sum(
        1 for _, _, names in os.walk(directory) for name in names if not name.startswith(".")
    )


def temporary_count(directory: pathlib.Path) -> int:
    return sum(1 for _, _, names in os.walk(directory) for name in names if name.endswith(".tmp"))


def wait_for(condition, what: str, limit_s: float = 120.0, poll_s: float = 0.02) -> None:
    """Poll until ``condition()``; a deadline only turns a hang into a failure."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def big_reference() -> dict[int, list[tuple[int, ...]]]:
    return {
        seed: tokens(generate(big_block_config(), workload(seed, prompt_len=70)))
        for seed in (0, 1, 2)
    }


@pytest.mark.slow
def test_a_writer_killed_mid_save_leaves_a_readable_store(tmp_path: pathlib.Path, big_reference):
    writer = subprocess.Popen(
        store_process(tmp_path, "--rounds", "0", "--big", "--role", "kv_producer"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    try:
        # Kill it while a write is under way: once entries exist, at a moment
        # when a temporary file is present.
        wait_for(
            lambda: (
                (entry_count(tmp_path) >= 10 and temporary_count(tmp_path) > 0)
                or writer.poll() is not None
            ),
            "a write in progress",
            poll_s=0.0005,
        )
        assert writer.poll() is None, "the writer died on its own"
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    layout = BlockLayout.from_engine_config(big_block_config())
    assert count_torn_entries(str(tmp_path), layout) == 0
    config = shared_storage(big_block_config(), tmp_path)
    outputs = generate(config, workload(0, prompt_len=70))
    assert tokens(outputs) == big_reference[0]
    assert sum(output.external_tokens for output in outputs) > 0
    assert sum(output.num_load_failures for output in outputs) == 0


def run_in_private_mounts(directory: pathlib.Path, mount_commands: str) -> dict:
    """Run one engine on ``directory`` after ``mount_commands``, in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.fail("this test needs util-linux's unshare to mount in a private namespace")
    directory.mkdir(exist_ok=True)
    script = (
        f"{mount_commands} && exec {' '.join(store_process(directory, '--rounds', '1', '--big'))}"
    )
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_full_disk_fails_saves_but_the_engine_carries_on(tmp_path: pathlib.Path, big_reference):
    disk = tmp_path / "small-disk"
    # 600 KiB: room for four entries of 128 KiB.
    report = run_in_private_mounts(disk, f"mount -t tmpfs -o size=600k kvwire-full {disk}")
    assert report["tokens"] == [list(t) for t in big_reference[0]]
    assert report["stats"]["write_disk_full"] > 0
    assert report["stats"]["save_errors"] == report["stats"]["write_disk_full"]
    assert report["stats"]["blocks_saved"] > 0
    assert report["leftover_tmp_files"] == []
    assert report["torn_entries"] == 0


@pytest.fixture(scope="module")
def big_reference_kv() -> dict[int, dict[str, torch.Tensor]]:
    """The prompt KV each request has without a connector, to compare loads with."""
    kv = {}
    for seed in (0, 1, 2):
        with LLMEngine(big_block_config(), capture_kv=True) as engine:
            engine.generate(workload(seed, prompt_len=70))
            kv[seed] = dict(engine.captured_kv)
    return kv


@pytest.mark.slow
def test_a_read_only_directory_fails_saves_but_the_engine_carries_on(
    tmp_path: pathlib.Path, big_reference
):
    store = tmp_path / "read-only"
    report = run_in_private_mounts(
        store, f"mount --bind {store} {store} && mount -o remount,bind,ro {store}"
    )
    assert report["tokens"] == [list(t) for t in big_reference[0]]
    assert report["stats"]["write_permission_denied"] > 0
    assert report["stats"]["save_errors"] == report["stats"]["write_permission_denied"]
    assert report["leftover_tmp_files"] == []


@pytest.mark.slow
def test_a_consumer_loads_bit_exact_while_a_producer_writes(
    tmp_path: pathlib.Path, big_reference, big_reference_kv
):
    producer = subprocess.Popen(
        store_process(
            tmp_path, "--rounds", "0", "--big", "--distinct", "3", "--role", "kv_producer"
        ),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    consumer_config = with_connector(
        big_block_config(),
        "SharedStorageConnector",
        {"shared_storage_path": str(tmp_path)},
        kv_role="kv_consumer",
    )
    try:
        wait_for(lambda: entry_count(tmp_path) > 0, "the producer's first entry")
        served = 0
        for round_number in range(6):
            seed = round_number % 3
            consumer = LLMEngine(consumer_config, capture_kv=True)
            with consumer:
                outputs = consumer.generate(workload(seed, prompt_len=70))
                stats = consumer.connector_stats.reduce()
            assert producer.poll() is None, "the producer died"
            assert tokens(outputs) == big_reference[seed]
            for request_id, kv in consumer.captured_kv.items():
                assert torch.equal(kv, big_reference_kv[seed][request_id]), request_id
            assert sum(output.num_load_failures for output in outputs) == 0
            assert "corrupt_entries" not in stats
            served += sum(output.external_tokens for output in outputs)
        assert served > 0
    finally:
        producer.kill()
        producer.wait()


def entry_files(directory: pathlib.Path) -> list[pathlib.Path]:
    return [path for path in directory.rglob("*") if path.is_file() and path.name[0] != "."]


def test_an_engine_recomputes_entries_longer_than_their_header_says(tmp_path: pathlib.Path):
    config = tiny_config()
    requests = workload(5)
    reference = tokens(generate(config, requests))
    generate(shared_storage(config, tmp_path), requests)
    grown = entry_files(tmp_path)
    assert grown
    for path in grown:
        with path.open("ab") as entry:
            entry.write(b"trailing bytes")
    with LLMEngine(shared_storage(config, tmp_path)) as consumer:
        outputs = consumer.generate(renamed(requests, "-again"))
        stats = consumer.connector_stats.reduce()
    assert tokens(outputs) == reference
    assert sum(output.num_load_failures for output in outputs) > 0
    assert stats["corrupt_entries"] > 0
    # Discarded, then saved again whole by the engine that recomputed them.
    assert not any(path.read_bytes().endswith(b"trailing bytes") for path in entry_files(tmp_path))
