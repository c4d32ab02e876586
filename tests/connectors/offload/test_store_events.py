"""Through the engine: the store-backed connectors report the KV cache events of their store.

The check throughout: replaying the events the scheduler collected gives
exactly the entries the directory holds.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

import pytest

from kvwire.blocks.format import BlockLayout
from kvwire.config import EngineConfig
from kvwire.engine.engine import LLMEngine, WorkerMode
from kvwire.interface.types import BlockHash, BlockRemoved, BlockStored, KVCacheEvent
from tests.support.engines import (
    renamed,
    shared_storage,
    tiered_disk,
    tiny_config,
    workload,
)


def hashes_on_disk(root: pathlib.Path) -> list[BlockHash]:
    """The block hash of every entry file under ``root`` (temporary files start with a dot)."""
    return sorted(
        bytes.fromhex(p.name) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
    )


def stored(events: Iterable[KVCacheEvent], medium: str) -> list[BlockHash]:
    return [
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == medium
        for h in e.block_hashes
    ]


def removed(events: Iterable[KVCacheEvent], medium: str) -> list[BlockHash]:
    return [
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    ]


def replay(events: Iterable[KVCacheEvent], medium: str) -> list[BlockHash]:
    """The blocks a router following ``events`` believes ``medium`` holds."""
    held: set[BlockHash] = set()
    for event in events:
        if event.medium != medium:
            continue
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        else:
            held.difference_update(event.block_hashes)
    return sorted(held)


def run(
    config: EngineConfig, suffix: str = "", worker_mode: WorkerMode = "inline"
) -> list[KVCacheEvent]:
    """The workload on a fresh engine, its saves waited for; the events its scheduler collected."""
    with LLMEngine(config, worker_mode=worker_mode) as engine:
        engine.generate(renamed(workload(), suffix))
        engine.wait_for_saves()
        return list(engine.scheduler.kv_events)


@pytest.mark.parametrize("worker_mode", ["inline", "process"])
def test_shared_storage_reports_each_block_it_saved_once(
    tmp_path: pathlib.Path, worker_mode: WorkerMode
) -> None:
    events = run(shared_storage(tiny_config(), tmp_path), worker_mode=worker_mode)
    on_disk = hashes_on_disk(tmp_path)
    assert on_disk
    assert sorted(stored(events, "disk")) == on_disk
    assert removed(events, "disk") == []
    assert {e.medium for e in events} == {"disk"}


def test_a_corrupt_entry_discarded_on_load_is_reported_removed(tmp_path: pathlib.Path) -> None:
    config = shared_storage(tiny_config(), tmp_path)
    with LLMEngine(config) as engine:
        engine.generate(workload())
        engine.wait_for_saves()
        first_block = engine.scheduler.requests[workload()[0].request_id].block_hashes[0]
        cold = list(engine.scheduler.kv_events)
    folder = tmp_path / BlockLayout.from_engine_config(config).fingerprint_hex
    entry = folder / first_block.hex()[:2] / first_block.hex()
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0x01
    entry.write_bytes(bytes(data))

    warm = run(config, "-warm")

    assert removed(warm, "disk") == [first_block]
    # Computed again after the failed load, and saved again: the store healed.
    assert first_block in stored(warm, "disk")
    assert first_block in hashes_on_disk(tmp_path)
    assert replay(cold + warm, "disk") == hashes_on_disk(tmp_path)


def test_entries_the_size_cap_evicts_are_reported_removed(tmp_path: pathlib.Path) -> None:
    entry_bytes = BlockLayout.from_engine_config(tiny_config()).entry_bytes
    # One writer thread: the order of the events is the order of the writes.
    config = shared_storage(
        tiny_config(), tmp_path, max_bytes=4 * entry_bytes, batch_blocks=1, io_threads=1
    )
    events = run(config)
    evicted = removed(events, "disk")
    assert evicted
    assert set(evicted) <= set(stored(events, "disk"))
    assert replay(events, "disk") == hashes_on_disk(tmp_path)


def test_the_tiered_profile_reports_each_event_once_with_its_medium(
    tmp_path: pathlib.Path,
) -> None:
    config = tiered_disk(tiny_config(), tmp_path)
    events = run(config)
    on_disk = hashes_on_disk(tmp_path)
    assert sorted(stored(events, "disk")) == on_disk
    # CPU offload's scheduler side reports its own tier: the same blocks, once each.
    assert sorted(stored(events, "cpu")) == on_disk
    assert {e.medium for e in events} == {"cpu", "disk"}
