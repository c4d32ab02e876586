"""Saves that end after the engine's last compute step still reach its stats and KV events.

Store-backed connectors write in the background, straight from the cache
blocks, and keep a finished request's blocks until its saves end: writes can
run long after the last step that computed anything, and ``generate`` waits
for them (the requests are reported finished sending only then). A store
whose writes wait while a file exists (:mod:`tests.support.stores`)
makes that certain: the file goes only once every request has finished.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Sequence

import attrs
import pytest

from kvwire.blocks.format import BlockLayout
from kvwire.config import EngineConfig, KVTransferConfig, SchedulerConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput, WorkerMode
from kvwire.interface.types import BlockStored, KVCacheEvent, Request
from kvwire.run.passes import compare_passes
from tests.support.engines import generate
from tests.support.redis import distinct_full_blocks

WORKER_MODES: tuple[WorkerMode, ...] = ("inline", "process")


def held_storage(config: EngineConfig, tmp_path: pathlib.Path) -> EngineConfig:
    """``config`` saving to ``tmp_path/store``; each write waits while ``tmp_path/hold`` exists."""
    return attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HeldSharedStorageConnector",
            kv_connector_module_path="tests.support.stores",
            kv_role="kv_both",
            kv_connector_extra_config={
                "shared_storage_path": str(tmp_path / "store"),
                # Room for every block of the workload in flight: a save
                # beyond the bound would be dropped.
                "max_save_bytes_in_flight": "4MiB",
                "hold_path": str(tmp_path / "hold"),
            },
        ),
    )


def blocks_computed(
    requests: Sequence[GenerationRequest], outputs: Sequence[RequestOutput], block_size: int
) -> int:
    """Different full blocks the engine computed: each is saved once.

    Every token but the last sampled one went through the model; a prefix
    common to several requests counts once.
    """
    computed = [
        (*request.prompt_token_ids, *output.output_token_ids[:-1])
        for request, output in zip(requests, outputs, strict=True)
    ]
    return distinct_full_blocks(computed, block_size)


def hashes_stored(directory: pathlib.Path) -> list[bytes]:
    """The block hash of every entry in the store (its temporary files start with a dot)."""
    return sorted(
        bytes.fromhex(name)
        for _, _, names in os.walk(directory)
        for name in names
        if not name.startswith(".")
    )


def entries_stored(directory: pathlib.Path) -> int:
    return len(hashes_stored(directory))


def assert_each_stored_block_reported_once(
    events: Sequence[KVCacheEvent], directory: pathlib.Path
) -> None:
    """``events`` report each block stored in ``directory`` as stored on disk, once."""
    assert all(isinstance(e, BlockStored) and e.medium == "disk" for e in events)
    reported = sorted(h for e in events for h in e.block_hashes)
    on_disk = hashes_stored(directory)
    assert reported == on_disk and on_disk


def released_when_all_finish(hold: pathlib.Path, count: int) -> Callable[[Request], None]:
    """An ``on_finished`` callback that removes ``hold`` once ``count`` requests have finished."""
    finished: list[str] = []

    def on_finished(request: Request) -> None:
        finished.append(request.request_id)
        if len(finished) == count:
            hold.unlink()

    return on_finished


@pytest.mark.parametrize("worker_mode", WORKER_MODES)
def test_saves_ending_after_the_last_step_are_counted_and_reported_before_generate_returns(
    worker_mode: WorkerMode,
    config: EngineConfig,
    workload: list[GenerationRequest],
    tmp_path: pathlib.Path,
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    engine = LLMEngine(held_storage(config, tmp_path), worker_mode=worker_mode)
    with engine:
        outputs = engine.generate(workload, released_when_all_finish(hold, len(workload)))
        when_generate_returned = dict(engine.connector_stats.data)
    assert not hold.exists()
    stats = engine.connector_stats.data
    # Their requests kept their blocks until the saves ended: all counted by then.
    assert when_generate_returned == stats
    expected = blocks_computed(workload, outputs, config.cache_config.block_size)
    assert stats["blocks_saved"] == expected == entries_stored(tmp_path / "store")
    assert stats["bytes_saved"] == expected * BlockLayout.from_engine_config(config).payload_bytes
    assert "save_errors" not in stats and "saves_dropped" not in stats
    # Their KV cache events reach the scheduler too, each once.
    assert_each_stored_block_reported_once(engine.scheduler.kv_events, tmp_path / "store")


@pytest.mark.parametrize("worker_mode", WORKER_MODES)
def test_wait_for_saves_after_generate_finds_nothing_more_to_count(
    worker_mode: WorkerMode,
    config: EngineConfig,
    workload: list[GenerationRequest],
    tmp_path: pathlib.Path,
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    with LLMEngine(held_storage(config, tmp_path), worker_mode=worker_mode) as engine:
        outputs = engine.generate(workload, released_when_all_finish(hold, len(workload)))
        engine.wait_for_saves()
        after_waiting = dict(engine.connector_stats.data)
        events = list(engine.scheduler.kv_events)
    expected = blocks_computed(workload, outputs, config.cache_config.block_size)
    assert after_waiting["blocks_saved"] == expected == entries_stored(tmp_path / "store")
    # Closing finds nothing left to count: no save is counted twice.
    assert engine.connector_stats.data == after_waiting
    # The stored blocks reach the scheduler's events too, each once.
    assert_each_stored_block_reported_once(events, tmp_path / "store")


def test_kvwire_run_counts_saves_that_end_after_a_pass_in_that_pass(
    config: EngineConfig, workload: list[GenerationRequest], tmp_path: pathlib.Path
) -> None:
    # One request at a time, and from the first one's end the writes wait
    # until the last one has ended: every later request's saves end after
    # the cold pass's last step.
    one_at_a_time = attrs.evolve(config, scheduler_config=SchedulerConfig(max_num_seqs=1))
    hold = tmp_path / "hold"
    cold_requests_done = 0

    def on_request_done(label: str) -> None:
        nonlocal cold_requests_done
        if label != "cold":
            return
        cold_requests_done += 1
        if cold_requests_done == 1:
            hold.touch()
        if cold_requests_done == len(workload):
            hold.unlink()

    report = compare_passes(
        held_storage(one_at_a_time, tmp_path), workload, on_request_done=on_request_done
    )
    assert cold_requests_done == len(workload) and not hold.exists()
    assert report["ok"]
    expected = blocks_computed(workload, generate(config, workload), config.cache_config.block_size)
    payload_bytes = BlockLayout.from_engine_config(config).payload_bytes
    assert report["passes"]["cold"]["bytes_saved"] == expected * payload_bytes


def test_a_multi_connector_waits_for_every_childs_saves(
    config: EngineConfig, workload: list[GenerationRequest], tmp_path: pathlib.Path
) -> None:
    held = held_storage(config, tmp_path).kv_transfer_config
    assert held is not None
    children = [
        {"kv_connector": "CPUOffloadConnector"},
        {
            "kv_connector": held.kv_connector,
            "kv_connector_module_path": held.kv_connector_module_path,
            "kv_connector_extra_config": held.kv_connector_extra_config,
        },
    ]
    multi = attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": children},
        ),
    )
    hold = tmp_path / "hold"
    hold.touch()
    with LLMEngine(multi) as engine:
        # The held child's writes end only after every request has finished:
        # the requests stay kept until both children's saves have ended.
        outputs = engine.generate(workload, released_when_all_finish(hold, len(workload)))
        when_generate_returned = dict(engine.connector_stats.data)
    expected = blocks_computed(workload, outputs, config.cache_config.block_size)
    assert when_generate_returned["CPUOffloadConnector"]["blocks_saved"] == expected
    assert when_generate_returned["HeldSharedStorageConnector"]["blocks_saved"] == expected
