"""The parallel layout is a provider: rank 1's worker connector, built in a process of its own.

The container's ``parallel_config`` says which rank a connector serves (a
vLLM worker overrides it with its own; so does this test, in a spawned
process, as a deployment's hook would). Rank 1 of a TP=2 engine holds KV
head 1 of the model's 2: its connector stores entries of that head only,
whose bytes are rank 1's, and a lookup of the TP=2 engine finds the block
only once rank 0's entry is stored too.
"""

from __future__ import annotations

import multiprocessing
import pathlib
from typing import Any

import pytest
import torch
from dependency_injector import providers

from kvwire.blocks.format import HEADER_SIZE, BlockLayout, HeadShard, verify_entry
from kvwire.blocks.shards import entry_layout
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config import ParallelConfig
from kvwire.config.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from kvwire.config.profile import load_profile
from kvwire.connectors.offload.metadata import OffloadMetadata
from kvwire.container import container_for_profile
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import ForwardContext

LAYERS = ("layers.0", "layers.1")
BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS = 4, 8, 6
HASHES = tuple(bytes([i]) * 32 for i in range(1, 3))


def rank_profile(directory: str) -> dict[str, Any]:
    """A TP=2 engine's profile; its model_config is one rank's share (one KV head of two)."""
    return {
        "model_config": {
            "num_layers": 2,
            "num_attention_heads": 2,
            "num_kv_heads": 1,
            "head_size": HEAD_SIZE,
            "vocab_size": 64,
            "max_model_len": 64,
        },
        "cache_config": {"block_size": BLOCK_SIZE, "num_gpu_blocks": NUM_BLOCKS},
        "parallel_config": {"tensor_parallel_size": 2},
        "kv_transfer_config": {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": directory},
        },
    }


def cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE)
    block_bytes = 2 * BLOCK_SIZE * HEAD_SIZE * 4
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size_bytes=NUM_BLOCKS * block_bytes, shared_by=[name]) for name in LAYERS
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=spec)],
    )


def rank_caches(rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_SIZE)
    return {name: torch.randn(shape, generator=generator) for name in LAYERS}


def save_as_rank(directory: str, rank: int) -> None:
    """Build this rank's worker connector through the container, save blocks 1 and 2, stop."""
    container = container_for_profile(
        rank_profile(directory), role=KVConnectorRole.WORKER, kv_cache_config=cache_config()
    )
    container.parallel_config.override(
        providers.Object(ParallelConfig(tensor_parallel_size=2, rank=rank))
    )
    connector = container.connector()
    connector.register_kv_caches(rank_caches(rank))
    save = BlockTransfer(request_id="r", block_ids=(1, 2), block_hashes=HASHES)
    connector.bind_connector_metadata(OffloadMetadata(saves=(save,)))
    connector.start_load_kv(ForwardContext(layer_names=LAYERS))
    connector.wait_for_save()
    connector.clear_connector_metadata()
    assert connector.wait_for_pending_saves(30)
    container.shutdown_resources()


def in_own_process(directory: str, rank: int) -> None:
    process = multiprocessing.get_context("spawn").Process(
        target=save_as_rank, args=(directory, rank)
    )
    process.start()
    process.join(120)
    assert process.exitcode == 0


def head_layout(directory: str, head: int) -> BlockLayout:
    """The layout of an entry of KV head ``head``, of the engine ``rank_profile`` describes."""
    rank = BlockLayout.from_engine_config(load_profile(rank_profile(directory)))
    return entry_layout(rank, HeadShard(head, head + 1, 2))


@pytest.mark.slow
def test_rank_ones_connector_built_in_its_own_process_stores_its_head(
    tmp_path: pathlib.Path,
) -> None:
    in_own_process(str(tmp_path), rank=1)
    assert not (tmp_path / head_layout(str(tmp_path), 0).fingerprint_hex).exists()
    expected = rank_caches(1)
    layout = head_layout(str(tmp_path), 1)
    for block_id, block_hash in zip((1, 2), HASHES, strict=True):
        path = tmp_path / layout.fingerprint_hex / block_hash.hex()[:2] / block_hash.hex()
        entry = memoryview(path.read_bytes())
        verify_entry(entry, layout, block_hash)
        payload = torch.frombuffer(bytearray(entry[HEADER_SIZE:]), dtype=torch.float32)
        want = torch.stack([expected[name][:, block_id] for name in LAYERS]).flatten()
        assert torch.equal(payload, want)
    # The TP=2 engine's lookup counts the blocks only once rank 0's entries are there too.
    scheduler = container_for_profile(
        rank_profile(str(tmp_path)), role=KVConnectorRole.SCHEDULER, kv_cache_config=cache_config()
    )
    index = scheduler.connector()._scheduler_half("lookup").index  # what a lookup asks
    assert index.count_held_prefix(0, HASHES) == 0
    in_own_process(str(tmp_path), rank=0)
    assert index.count_held_prefix(0, HASHES) == 2
    scheduler.shutdown_resources()
