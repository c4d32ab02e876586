"""The engine at tensor and pipeline parallelism: one worker process per rank, tokens unchanged.

Each rank holds its share of the KV heads and layers, and its connector
(built in its process, its rank injected through the container) moves only
that share; the ranks' reports merge as vLLM merges them. Every test
compares tokens with those of the unsplit engine without a connector.
"""

from __future__ import annotations

import pathlib
import shutil
import time
from typing import Any

import attrs
import pytest
import torch

from kvwire.blocks.format import HEADER_SIZE
from kvwire.config import EngineConfig, ModelConfig, ParallelConfig
from kvwire.engine.engine import LLMEngine, RequestOutput
from kvwire.engine.worker_process import WorkerProcessError
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.engines import (
    generate,
    served,
    shared_storage,
    tiny_config,
    tokens,
    with_connector,
)

pytestmark = pytest.mark.slow

WORKLOAD = synthetic_workload(
    WorkloadSpec(
        num_requests=4, prompt_len=30, output_len=5, shared_prefix_ratio=0.6, vocab_size=300, seed=5
    )
)


def _model(**sizes: int) -> EngineConfig:
    model = ModelConfig(num_layers=3, vocab_size=300, max_model_len=512)
    config = attrs.evolve(tiny_config(), model_config=model)
    return attrs.evolve(config, parallel_config=ParallelConfig(**sizes))


@attrs.frozen
class _Run:
    tokens: list[tuple[int, ...]]
    kv: dict[str, torch.Tensor]


def _run(config: EngineConfig) -> _Run:
    with LLMEngine(config, capture_kv=True) as engine:
        outputs = engine.generate(WORKLOAD)
        assert served(outputs) == 0
        return _Run(tokens(outputs), dict(engine.captured_kv))


@pytest.fixture(scope="module")
def unsplit() -> _Run:
    return _run(_model())


@pytest.fixture(scope="module")
def reference(unsplit: _Run) -> list[tuple[int, ...]]:
    return unsplit.tokens


@pytest.fixture(scope="module")
def tp2_written(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, _Run]:
    """Shared storage a TP=2 engine wrote the workload's prefixes to (one entry per head)."""
    storage = tmp_path_factory.mktemp("tp2-store")
    return storage, _run(shared_storage(_model(tensor_parallel_size=2), storage))


@pytest.fixture
def tp2_store(tp2_written: tuple[pathlib.Path, _Run]) -> pathlib.Path:
    return tp2_written[0]


def _copy(store: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    return copy


def test_a_tp2_engine_computes_the_unsplit_engine_s_tokens_and_kv(
    tp2_written: tuple[pathlib.Path, _Run], unsplit: _Run
) -> None:
    _storage, split = tp2_written
    assert split.tokens == unsplit.tokens
    # Each rank's heads, put together, are the unsplit engine's KV, bit for bit.
    assert split.kv.keys() == unsplit.kv.keys()
    for request_id, kv in unsplit.kv.items():
        assert split.kv[request_id].equal(kv)


def test_a_tp2_engine_is_served_its_own_entries_and_tp1_loads_them(
    tp2_store: pathlib.Path, tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    storage = _copy(tp2_store, tmp_path)
    warm, split_stats = _with_stats(shared_storage(_model(tensor_parallel_size=2), storage))
    assert tokens(warm) == reference
    assert served(warm) > 0
    # Entries of one head each: an unsplit engine that sets that reads them.
    unsplit, unsplit_stats = _with_stats(shared_storage(_model(), storage, entry_kv_heads=1))
    assert tokens(unsplit) == reference
    assert served(unsplit) == served(warm)
    # Stats are the ranks' summed: each entry moved counts once, on the rank that moved
    # it (the same entries either way), and each lookup once (the scheduler made it).
    assert split_stats["lookup_hit_blocks"] > 0
    for counter in ("blocks_loaded", "bytes_loaded", "lookup_hit_blocks", "lookup_miss_blocks"):
        assert split_stats.get(counter) == unsplit_stats.get(counter), counter


def _with_stats(config: EngineConfig) -> tuple[list[RequestOutput], dict[str, Any]]:
    with LLMEngine(config) as engine:
        outputs = engine.generate(WORKLOAD)
    return outputs, dict(engine.connector_stats.data)


def test_a_pp2_engine_s_entries_load_into_pp1(
    tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    split = shared_storage(_model(pipeline_parallel_size=2), tmp_path, entry_layers=1)
    with LLMEngine(split) as engine:
        assert [share.layers for share in engine.shares] == [range(0, 2), range(2, 3)]
        cold = engine.generate(WORKLOAD)
    assert tokens(cold) == reference
    assert served(cold) == 0
    unsplit = generate(shared_storage(_model(), tmp_path, entry_layers=1), WORKLOAD)
    assert tokens(unsplit) == reference
    assert served(unsplit) > 0


def _head_folders(storage: pathlib.Path) -> list[pathlib.Path]:
    """The store's folders of entries, one per layout: here one per KV head (so per rank)."""
    folders = sorted(path for path in storage.iterdir() if path.is_dir())
    assert len(folders) == 2
    return folders


@pytest.mark.parametrize("corrupted", [0, 1])
def test_a_shard_corrupted_on_one_rank_is_computed_again_on_every_rank(
    corrupted: int,
    tp2_store: pathlib.Path,
    tmp_path: pathlib.Path,
    reference: list[tuple[int, ...]],
) -> None:
    storage = _copy(tp2_store, tmp_path)
    for entry in _head_folders(storage)[corrupted].rglob("*"):
        if entry.is_file():
            data = bytearray(entry.read_bytes())
            data[HEADER_SIZE + 5] ^= 0xFF
            entry.write_bytes(bytes(data))
    outputs = generate(shared_storage(_model(tensor_parallel_size=2), storage), WORKLOAD)
    # Only one rank's loads failed; without the union, the other would keep what it loaded
    # and the failed rank the garbage: the tokens would differ.
    assert sum(output.num_load_failures for output in outputs) > 0
    assert tokens(outputs) == reference


def test_a_shard_missing_on_one_rank_is_a_miss_for_the_whole_block(
    tp2_store: pathlib.Path, tmp_path: pathlib.Path, reference: list[tuple[int, ...]]
) -> None:
    storage = _copy(tp2_store, tmp_path)
    shutil.rmtree(_head_folders(storage)[1])
    outputs = generate(shared_storage(_model(tensor_parallel_size=2), storage), WORKLOAD)
    assert served(outputs) == 0
    assert sum(output.num_load_failures for output in outputs) == 0
    assert tokens(outputs) == reference


def test_a_rank_that_fails_stops_every_rank_at_once(tmp_path: pathlib.Path) -> None:
    config = with_connector(
        _model(tensor_parallel_size=2),
        "RankOneFailingConnector",
        {"store_dir": str(tmp_path)},
        module_path="tests.support.misbehaving_connectors",
    )
    engine = LLMEngine(config, worker_reply_timeout_s=120)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerProcessError, match="rank 1's connector broke"):
            engine.generate(WORKLOAD[:1])
        # Rank 0 waits for rank 1's heads in the step's first layer: left running, it
        # would answer only when that exchange timed out (120 s here, as the replies).
        assert time.monotonic() - started < 60
    finally:
        engine.close()
