"""The Redis medium driven directly, with no connector, against real servers.

A scheduler-side medium and worker-side ones are separate objects, as in
separate processes, each building its own half over the same server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config.extra_config import ExtraConfigError, read_extra_config
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockStored
from kvwire.media.base import MediumContext
from kvwire.media.store._handler import StoreTransferHandler
from kvwire.media.store.redis import RedisBlockStore, RedisClusterBlockStore, RedisMedium
from tests.support.media import DrivenHandler
from tests.support.redis import LocalCluster, RedisServer
from tests.support.stores import layout_caches

CONNECTOR = "TestRedisConnector"
LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
OTHER_LAYOUT = BlockLayout(
    num_layers=2, block_size=4, num_kv_heads=2, head_size=16, dtype="float32"
)
GROUPS = (CacheGroup(index=0, layer_names=("layers.0", "layers.1"), block_size=4),)
NUM_BLOCKS = 8
HASHES = tuple(bytes([i]) + bytes(range(31)) for i in range(1, 4))


def context(extra: dict[str, Any], layout: BlockLayout = LAYOUT) -> MediumContext:
    """The context a connector would build: the medium's keys read, then finished."""
    options = read_extra_config(CONNECTOR, extra, RedisMedium.extra_config_keys())
    return MediumContext(
        connector_name=CONNECTOR,
        options=RedisMedium.finish_options(CONNECTOR, options),
        groups=GROUPS,
        layout=layout,
    )


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Halves to close at the end of the test (index or handler)."""
    halves: list[Any] = []
    yield halves
    for half in reversed(halves):
        half.close()


def handler_over(
    medium: RedisMedium, caches: dict[str, torch.Tensor], closing: list[Any]
) -> DrivenHandler[StoreTransferHandler]:
    handler = DrivenHandler(medium.build_handler(caches, Counters()))
    closing.append(handler)
    return handler


def save(handler: DrivenHandler[StoreTransferHandler], hashes: tuple[bytes, ...]) -> None:
    block_ids = tuple(range(1, len(hashes) + 1))
    handler.save([BlockTransfer(request_id="p", block_ids=block_ids, block_hashes=hashes)])
    assert handler.wait_for_saves(30)


@pytest.mark.parametrize("deployment", ["single", "cluster"])
def test_blocks_round_trip_bit_exact_and_the_index_counts_them(
    deployment: str,
    request: pytest.FixtureRequest,
    key_prefix: str,
    closing: list[Any],
):
    if deployment == "single":
        server: RedisServer = request.getfixturevalue("redis_server")
        url, store_class = server.url, RedisBlockStore
    else:
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        url, store_class = cluster.url, RedisClusterBlockStore
    extra = {"url": url, "key_prefix": key_prefix}
    produced = layout_caches(LAYOUT, 11, NUM_BLOCKS)
    producer_medium = RedisMedium(context(extra))
    producer = handler_over(producer_medium, produced, closing)
    assert type(producer_medium.store) is store_class
    save(producer, HASHES)
    assert producer.take_events() == [BlockStored(HASHES, "redis", 0)]

    index = RedisMedium(context(extra)).build_index()
    closing.append(index)
    assert index.count_held_prefix(0, HASHES) == 3
    assert index.count_held_prefix(0, (HASHES[2][::-1], *HASHES)) == 0

    loaded = layout_caches(LAYOUT, None, NUM_BLOCKS)
    consumer = handler_over(RedisMedium(context(extra)), loaded, closing)
    consumer.start_loads(
        [BlockTransfer(request_id="c", block_ids=(5, 6, 7), block_hashes=HASHES)], []
    )
    consumer.wait_for_loads()
    assert consumer.take_load_errors() == set()
    for name in sorted(produced):
        assert torch.equal(
            produced[name][:, 1:4].view(torch.int32), loaded[name][:, 5:8].view(torch.int32)
        )


def test_reset_clears_only_this_layouts_blocks(
    redis_server: RedisServer, key_prefix: str, closing: list[Any]
):
    extra = {"url": redis_server.url, "key_prefix": key_prefix}
    save(
        handler_over(RedisMedium(context(extra)), layout_caches(LAYOUT, 1, NUM_BLOCKS), closing),
        HASHES,
    )
    other = RedisMedium(context(extra, OTHER_LAYOUT))
    save(handler_over(other, layout_caches(OTHER_LAYOUT, 2, NUM_BLOCKS), closing), HASHES)
    index = RedisMedium(context(extra)).build_index()
    other_index = RedisMedium(context(extra, OTHER_LAYOUT)).build_index()
    closing.extend([index, other_index])
    assert index.reset() is True
    assert index.count_held_prefix(0, HASHES) == 0
    assert other_index.count_held_prefix(0, HASHES) == 3


def test_reset_during_an_outage_says_blocks_may_have_stayed(
    fault_server: RedisServer, key_prefix: str, closing: list[Any]
):
    extra = {"url": fault_server.url, "key_prefix": key_prefix, "connect_timeout_s": 0.5}
    index = RedisMedium(context(extra)).build_index()
    closing.append(index)
    fault_server.kill()
    assert index.reset() is False


def test_bad_settings_are_refused_together_naming_the_connector():
    with pytest.raises(ExtraConfigError) as raised:
        context({"url": "redis://127.0.0.1:6379/0", "pool_size": 0, "ttl_seconds": -1})
    message = str(raised.value)
    assert message.startswith(f"{CONNECTOR}: invalid Redis settings")
    assert "kv_connector_extra_config.pool_size" in message
    assert "kv_connector_extra_config.ttl_seconds" in message


def test_the_late_write_grace_covers_two_socket_timeouts():
    assert RedisMedium(context({"socket_timeout_s": 1})).late_write_grace_s() == 10.0
    assert RedisMedium(context({"socket_timeout_s": 7})).late_write_grace_s() == 14.0


def test_the_settings_and_the_common_keys_are_read_together():
    medium = RedisMedium(context({"url": "redis://127.0.0.1:1/3", "io_threads": 2}))
    assert medium.settings.url == "redis://127.0.0.1:1/3"
    assert medium.context.options["io_threads"] == 2
    assert medium.event_medium == "redis"
