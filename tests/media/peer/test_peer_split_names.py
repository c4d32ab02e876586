"""How a split engine's peer names its ranks' shares, agents and directory entries."""

from __future__ import annotations

import pytest

from kvwire.blocks.format import BlockLayout, HeadShard, LayerShard
from kvwire.config import ParallelConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import OffloadConnector
from kvwire.media.base import MediumContext
from kvwire.media.peer import PeerMedium
from kvwire.media.peer._split import agent_name, rank_layout, split_fingerprints
from tests.support.connectors import read_options
from tests.support.peers import peer_config

# One rank's share of a model of 4 KV heads and 4 layers, at TP=2 and PP=2.
SHARE = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
UNSPLIT = ParallelConfig()
TP2 = ParallelConfig(tensor_parallel_size=2)
PP2 = ParallelConfig(pipeline_parallel_size=2, pipeline_layers=(0, 2, 4))
TP2_PP2 = ParallelConfig(
    tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_layers=(0, 2, 4)
)


def test_each_rank_names_the_heads_and_layers_it_holds() -> None:
    assert [rank_layout(SHARE, TP2, r).kv_heads for r in (0, 1)] == [
        HeadShard(0, 2, 4),
        HeadShard(2, 4, 4),
    ]
    assert [rank_layout(SHARE, PP2, r).layers for r in (0, 1)] == [
        LayerShard(0, 2, 4),
        LayerShard(2, 4, 4),
    ]
    shares = {rank_layout(SHARE, TP2_PP2, r).fingerprint for r in range(4)}
    assert len(shares) == 4
    assert rank_layout(SHARE, UNSPLIT, 0) == SHARE


def test_unequal_stages_name_their_own_layer_counts() -> None:
    stages = ParallelConfig(pipeline_parallel_size=2, pipeline_layers=(0, 2, 3))
    assert [rank_layout(SHARE, stages, r).num_layers for r in (0, 1)] == [2, 1]


def test_the_directory_names_the_split_the_same_from_every_rank() -> None:
    for parallel in (TP2, PP2, TP2_PP2):
        names = {
            split_fingerprints((rank_layout(SHARE, parallel, r),), parallel)
            for r in range(parallel.world_size)
        }
        assert len(names) == 1
    every = {split_fingerprints((SHARE,), p) for p in (UNSPLIT, TP2, PP2, TP2_PP2)}
    assert len(every) == 4
    # Unsplit, a block's entry keeps the name it always had.
    assert split_fingerprints((SHARE,), UNSPLIT) == (SHARE.fingerprint_hex,)


def test_each_rank_has_an_agent_no_other_peer_can_be_named() -> None:
    names = {agent_name("kvwire-e", TP2_PP2, r) for r in range(4)}
    assert len(names) == 4
    assert all(" " in name for name in names)
    assert agent_name("kvwire-e", UNSPLIT, 0) == "kvwire-e"


def test_pipeline_stages_without_their_layers_are_refused_naming_the_field() -> None:
    config = peer_config("redis://127.0.0.1:6379/0", "test:")
    assert config.kv_transfer_config is not None
    _, options = read_options(OffloadConnector, config.kv_transfer_config)
    context = MediumContext(
        "c", options, (), SHARE, parallel=ParallelConfig(pipeline_parallel_size=2)
    )
    with pytest.raises(ExtraConfigError, match=r"pipeline_layers"):
        PeerMedium(context)
