"""Entries of groups of KV heads: what one tensor-parallel size stores, another loads.

The directory medium driven directly, one medium object per rank as in
separate processes: a rank's caches hold its share of the heads (rank ``r``
of 2 holds head ``r`` of the model's 2), and a scheduler-side index of the
same engine counts a block only when every rank's entry of it is stored.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

from kvwire.blocks.format import HEADER_SIZE, BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config import ParallelConfig
from kvwire.config.extra_config import read_extra_config
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockStored
from kvwire.media.base import MediumContext, TransferHandler
from kvwire.media.store.directory import DirectoryMedium
from tests.support.media import DrivenHandler
from tests.support.stores import layout_caches

CONNECTOR = "TestStoreConnector"
MODEL = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
RANK_LAYOUT = attrs.evolve(MODEL, num_kv_heads=1)
GROUP = (CacheGroup(index=0, layer_names=("layers.0", "layers.1"), block_size=4),)
HASHES = tuple(bytes([i]) + bytes(range(31)) for i in range(1, 4))
NUM_BLOCKS = 8


def medium(storage: pathlib.Path, parallel: ParallelConfig, **extra: Any) -> DirectoryMedium:
    """The directory medium of one rank: its layout is the rank's share of the model's heads."""
    extra = {"shared_storage_path": str(storage), **extra}
    options = read_extra_config(CONNECTOR, extra, DirectoryMedium.extra_config_keys())
    layout = attrs.evolve(MODEL, num_kv_heads=MODEL.num_kv_heads // parallel.tensor_parallel_size)
    return DirectoryMedium(
        MediumContext(
            CONNECTOR,
            DirectoryMedium.finish_options(CONNECTOR, options),
            GROUP,
            layout,
            parallel=parallel,
        )
    )


def tp(rank: int) -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=2, rank=rank)


def rank_caches(model_caches: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of 2's caches: its head of every layer, as a TP worker holds them."""
    return {
        name: cache[:, :, :, rank : rank + 1].contiguous() for name, cache in model_caches.items()
    }


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    halves: list[Any] = []
    yield halves
    for half in reversed(halves):
        half.close()


def handler(
    of: DirectoryMedium, caches: dict[str, torch.Tensor], closing: list[Any]
) -> DrivenHandler[TransferHandler]:
    built = DrivenHandler(of.build_handler(caches, Counters()))
    closing.append(built)
    return built


def save(
    worker: DrivenHandler[TransferHandler], block_ids: tuple[int, ...], hashes: tuple[bytes, ...]
) -> None:
    worker.save([BlockTransfer(request_id="p", block_ids=block_ids, block_hashes=hashes)])
    assert worker.wait_for_saves(30)


def load(
    worker: TransferHandler, block_ids: tuple[int, ...], hashes: tuple[bytes, ...]
) -> set[int]:
    worker.start_loads(
        [BlockTransfer(request_id="c", block_ids=block_ids, block_hashes=hashes)], []
    )
    worker.wait_for_loads()
    return worker.take_load_errors()


def same_blocks(a: dict[str, torch.Tensor], a_ids, b: dict[str, torch.Tensor], b_ids) -> bool:
    return all(
        torch.equal(
            a[name][:, list(a_ids)].view(torch.int32), b[name][:, list(b_ids)].view(torch.int32)
        )
        for name in a
    )


def test_entries_written_at_tp2_load_at_tp1_bit_exact(tmp_path, closing):
    written = layout_caches(MODEL, 3, NUM_BLOCKS)
    for rank in (0, 1):
        rank_handler = handler(medium(tmp_path, tp(rank)), rank_caches(written, rank), closing)
        save(rank_handler, (1, 2, 3), HASHES)
        # Each rank reports its blocks stored (vLLM's scheduler side needs every rank's).
        assert rank_handler.take_events() == [BlockStored(HASHES, "disk", 0)]
    reader = medium(tmp_path, ParallelConfig(), entry_kv_heads=1)
    index = reader.build_index()
    closing.append(index)
    assert index.count_held_prefix(0, HASHES) == 3
    loaded = layout_caches(MODEL, None, NUM_BLOCKS)
    assert load(handler(reader, loaded, closing), (5, 6, 7), HASHES) == set()
    assert same_blocks(written, (1, 2, 3), loaded, (5, 6, 7))
    # The TP=1 reader's worker saw both its entries of each block stored as one block.


def test_entries_written_at_tp1_load_at_tp2_bit_exact(tmp_path, closing):
    written = layout_caches(MODEL, 4, NUM_BLOCKS)
    writer = handler(medium(tmp_path, ParallelConfig(), entry_kv_heads=1), written, closing)
    save(writer, (1, 2), HASHES[:2])
    # Two entries per block on this rank, one BlockStored per block.
    assert writer.take_events() == [BlockStored(HASHES[:2], "disk", 0)]
    index = medium(tmp_path, tp(0)).build_index()
    closing.append(index)
    assert index.count_held_prefix(0, HASHES) == 2
    for rank in (0, 1):
        loaded = rank_caches(layout_caches(MODEL, None, NUM_BLOCKS), rank)
        assert (
            load(handler(medium(tmp_path, tp(rank)), loaded, closing), (4, 5), HASHES[:2]) == set()
        )
        assert same_blocks(rank_caches(written, rank), (1, 2), loaded, (4, 5))


def test_a_block_one_rank_did_not_store_is_a_miss_for_the_whole_block(tmp_path, closing):
    written = layout_caches(MODEL, 5, NUM_BLOCKS)
    save(handler(medium(tmp_path, tp(0)), rank_caches(written, 0), closing), (1, 2), HASHES[:2])
    save(handler(medium(tmp_path, tp(1)), rank_caches(written, 1), closing), (1,), HASHES[:1])
    for parallel, extra in [(tp(0), {}), (ParallelConfig(), {"entry_kv_heads": 1})]:
        index = medium(tmp_path, parallel, **extra).build_index()
        closing.append(index)
        assert index.count_held_prefix(0, HASHES[:2]) == 1


def test_a_reader_of_whole_blocks_finds_no_entry_of_head_groups(tmp_path, closing):
    written = layout_caches(MODEL, 6, NUM_BLOCKS)
    for rank in (0, 1):
        save(
            handler(medium(tmp_path, tp(rank)), rank_caches(written, rank), closing),
            (1,),
            HASHES[:1],
        )
    index = medium(tmp_path, ParallelConfig()).build_index()
    closing.append(index)
    # Its entries hold all the heads: another layout, another name, a miss (never a wrong load).
    assert index.count_held_prefix(0, HASHES[:1]) == 0


def test_an_entry_corrupted_on_one_rank_fails_that_block_there(tmp_path, closing):
    written = layout_caches(MODEL, 7, NUM_BLOCKS)
    for rank in (0, 1):
        save(
            handler(medium(tmp_path, tp(rank)), rank_caches(written, rank), closing),
            (1, 2),
            HASHES[:2],
        )
    rank_one = medium(tmp_path, tp(1))
    (head_one,) = rank_one.stored_layouts[1:]
    victim = tmp_path / head_one.fingerprint_hex / HASHES[0].hex()[:2] / HASHES[0].hex()
    data = bytearray(victim.read_bytes())
    data[HEADER_SIZE + 5] ^= 0xFF
    victim.write_bytes(bytes(data))
    loaded = rank_caches(layout_caches(MODEL, None, NUM_BLOCKS), 0)
    assert load(handler(medium(tmp_path, tp(0)), loaded, closing), (4, 5), HASHES[:2]) == set()
    loaded = rank_caches(layout_caches(MODEL, None, NUM_BLOCKS), 1)
    assert load(handler(rank_one, loaded, closing), (4, 5), HASHES[:2]) == {4}


def test_bytes_stored_stay_within_a_tenth_over_the_kv(tmp_path, closing):
    # A block of a small real model's shape: 16 tokens, heads of 64, float16.
    model = BlockLayout(num_layers=2, block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    caches = {
        name: cache.to(torch.float16) for name, cache in layout_caches(model, 8, NUM_BLOCKS).items()
    }
    extra = {"shared_storage_path": str(tmp_path), "entry_kv_heads": 1}
    options = read_extra_config(CONNECTOR, extra, DirectoryMedium.extra_config_keys())
    one_head = DirectoryMedium(
        MediumContext(CONNECTOR, DirectoryMedium.finish_options(CONNECTOR, options), GROUP, model)
    )
    save(handler(one_head, caches, closing), (1, 2, 3), HASHES)
    stored = sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(tmp_path)
        for name in names
    )
    kv = 3 * model.payload_bytes
    assert kv < stored <= 1.1 * kv


def test_entry_kv_heads_that_do_not_divide_a_ranks_heads_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"entry_kv_heads: 2 does not divide the 1 KV heads"):
        medium(tmp_path, tp(0), entry_kv_heads=2)


def pp(rank: int) -> ParallelConfig:
    return ParallelConfig(pipeline_parallel_size=2, rank=rank, pipeline_layers=(0, 1, 2))


def stage_caches(model_caches: dict[str, torch.Tensor], stage: int) -> dict[str, torch.Tensor]:
    """Stage ``stage`` of 2's caches: its one layer, as a pipeline stage registers them."""
    name = f"layers.{stage}"
    return {name: model_caches[name]}


def stage_medium(storage: pathlib.Path, parallel: ParallelConfig, **extra: Any) -> DirectoryMedium:
    """A pipeline stage's directory medium: its layout and group hold its one layer."""
    extra = {"shared_storage_path": str(storage), **extra}
    options = read_extra_config(CONNECTOR, extra, DirectoryMedium.extra_config_keys())
    stage = parallel.pipeline_rank
    group = (CacheGroup(index=0, layer_names=(f"layers.{stage}",), block_size=4),)
    return DirectoryMedium(
        MediumContext(
            CONNECTOR,
            DirectoryMedium.finish_options(CONNECTOR, options),
            group,
            attrs.evolve(MODEL, num_layers=1),
            parallel=parallel,
        )
    )


def test_entries_written_by_two_pipeline_stages_load_unsplit_and_back(tmp_path, closing):
    written = layout_caches(MODEL, 9, NUM_BLOCKS)
    for stage in (0, 1):
        save(
            handler(stage_medium(tmp_path, pp(stage)), stage_caches(written, stage), closing),
            (1, 2),
            HASHES[:2],
        )
    index = stage_medium(tmp_path, pp(0)).build_index()
    closing.append(index)
    assert index.count_held_prefix(0, HASHES) == 2
    reader = medium(tmp_path, ParallelConfig(), entry_layers=1)
    loaded = layout_caches(MODEL, None, NUM_BLOCKS)
    assert load(handler(reader, loaded, closing), (4, 5), HASHES[:2]) == set()
    assert same_blocks(written, (1, 2), loaded, (4, 5))
    # And back: a stage reads its layer of what the unsplit engine stored.
    save(
        handler(medium(tmp_path, ParallelConfig(), entry_layers=1), written, closing),
        (3,),
        HASHES[2:],
    )
    loaded = stage_caches(layout_caches(MODEL, None, NUM_BLOCKS), 1)
    assert load(handler(stage_medium(tmp_path, pp(1)), loaded, closing), (6,), HASHES[2:]) == set()
    assert same_blocks(stage_caches(written, 1), (3,), loaded, (6,))


def test_a_block_one_stage_did_not_store_is_a_miss(tmp_path, closing):
    written = layout_caches(MODEL, 10, NUM_BLOCKS)
    save(
        handler(stage_medium(tmp_path, pp(1)), stage_caches(written, 1), closing), (1,), HASHES[:1]
    )
    index = stage_medium(tmp_path, pp(0)).build_index()
    closing.append(index)
    assert index.count_held_prefix(0, HASHES[:1]) == 0


def test_entry_layers_that_do_not_divide_the_stages_are_refused_by_name(tmp_path):
    parallel = ParallelConfig(pipeline_parallel_size=2, rank=0, pipeline_layers=(0, 1, 2))
    with pytest.raises(ValueError, match=r"entry_layers: 2 does not divide the pipeline stages"):
        stage_medium(tmp_path, parallel, entry_layers=2)
