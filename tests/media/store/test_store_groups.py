"""Shared storage on a hybrid cache: the store connectors' per-group rules, on files."""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Generator, Sequence

import attrs
import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.memory import BlockMemory
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import SharedStorageConnector
from kvwire.engine.engine import LLMEngine, build_kv_cache_config
from kvwire.engine.presets import apply_preset
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash
from kvwire.media.store._handler import StoreTransferHandler
from kvwire.media.store.base import CacheWrites
from kvwire.media.store.directory import DirectoryMedium
from kvwire.media.store.directory.block_store import DirectoryBlockStore
from tests.support.engines import (
    generate,
    renamed,
    served,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.media import DrivenHandler
from tests.support.pairs import (
    assert_a_tail_shorter_than_the_window_after_a_shared_prefix_hits_warm,
    assert_block_aligned_prompts_load_as_many_tokens_with_hma_on_as_off,
    blocks_equal,
    build_connector,
    engine_config,
    hybrid_engine_config,
    hybrid_kv_cache_config,
    scheduler_index,
)
from tests.support.stores import (
    HASHES,
    HybridFactory,
    HybridStorePair,
    StoreGroupsContract,
    layout_caches,
    store_medium,
)


@pytest.fixture
def hybrid(storage_dir: pathlib.Path, pairs: list[HybridStorePair]) -> HybridFactory:
    def build(**extra: object) -> HybridStorePair:
        options = {"shared_storage_path": str(storage_dir), "max_save_bytes_in_flight": "1MiB"}
        config = hybrid_engine_config("SharedStorageConnector", {**options, **extra})
        pair = HybridStorePair(SharedStorageConnector, config)
        pairs.append(pair)
        return pair

    return build


class TestSharedStorageGroups(StoreGroupsContract):
    pass


class _KeyedByHashOnly(DirectoryMedium):
    """A medium written before KV cache groups: its keys take a block hash only."""

    def store_key(self, block_hash: BlockHash) -> str:  # type: ignore[override]
        return self.layout.key(block_hash[::-1])

    def block_hash_of(self, key: str) -> BlockHash | None:
        block_hash = self.layout.block_hash_of(key)
        return None if block_hash is None else block_hash[::-1]


KEYED_BY_HASH_ONLY = f"{__name__}:{_KeyedByHashOnly.__name__}"


def test_a_store_key_taking_no_group_is_refused_on_a_hybrid_cache(
    storage_dir: pathlib.Path,
) -> None:
    config = hybrid_engine_config(
        "SharedStorageConnector",
        {"shared_storage_path": str(storage_dir), "medium": KEYED_BY_HASH_ONLY},
    )
    with pytest.raises(
        ExtraConfigError,
        match=r"^kv_connector_extra_config\.medium: _KeyedByHashOnly\(\) raised TypeError: "
        r"_KeyedByHashOnly\.store_key takes only a block hash, and this kv_cache_config "
        r"has 2 KV cache groups; expected store_key\(block_hash, group\).*"
        r"disable_hybrid_kv_cache_manager: true\)$",
    ):
        build_connector(
            SharedStorageConnector, config, KVConnectorRole.SCHEDULER, hybrid_kv_cache_config()
        )


def test_a_store_key_taking_no_group_still_names_a_single_groups_blocks(
    storage_dir: pathlib.Path,
) -> None:
    config = engine_config(
        "SharedStorageConnector",
        {"shared_storage_path": str(storage_dir), "medium": KEYED_BY_HASH_ONLY},
    )
    connector = build_connector(
        SharedStorageConnector, config, KVConnectorRole.SCHEDULER, build_kv_cache_config(config)
    )
    try:
        medium = store_medium(connector)
        assert isinstance(medium, _KeyedByHashOnly)
        block_hash = bytes(range(32))
        entry = memoryview(bytearray(medium.layout.entry_bytes))
        assert medium.store.put([medium.layout.key(block_hash[::-1])], [entry]) == [True]
        assert scheduler_index(connector).count_held_prefix(0, [block_hash]) == 1
    finally:
        connector.shutdown()


def _entries_under(folder: pathlib.Path) -> int:
    return sum(1 for path in folder.rglob("*") if path.is_file() and not path.name.startswith("."))


@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_a_hybrid_engine_with_hma_on_serves_a_warm_pass_from_both_groups_on_disk(
    storage_dir: pathlib.Path, async_load: bool
) -> None:
    hybrid_config = apply_preset(tiny_config(), "tiny-hybrid")
    reference = tokens(generate(hybrid_config, workload()))
    config = with_connector(
        hybrid_config,
        "SharedStorageConnector",
        {"shared_storage_path": str(storage_dir), "async_load": async_load},
    )
    with LLMEngine(config) as engine:
        assert engine.hma_enabled
        assert len(engine.kv_cache_config.kv_cache_groups) == 2
        cold = engine.generate(workload())
        engine.wait_for_saves()  # the warm pass finds every cold save
        engine.reset_prefix_cache()
        warm = engine.generate(renamed(workload(), "-warm"))
        engine.wait_for_saves()
        stats = engine.connector_stats.data
        connector = engine.scheduler_connector
        assert isinstance(connector, SharedStorageConnector)
        layouts = connector.group_layouts
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    hit_blocks = served(warm) // config.cache_config.block_size
    assert hit_blocks > 0 and stats["lookup_hit_blocks"] == hit_blocks
    # The full group loads every hit block; the sliding group only the last
    # two (its window of 8 tokens) of each request's hit: some, not all.
    sliding_loads = stats["blocks_loaded"] - hit_blocks
    assert 0 < sliding_loads < hit_blocks
    # Each group's entries lie under its own layout's folder; the sliding
    # group stored only its windows, fewer bytes than the full group.
    full_entries, sliding_entries = (
        _entries_under(storage_dir / layout.fingerprint_hex) for layout in layouts
    )
    assert 0 < sliding_entries < full_entries


def test_a_block_aligned_prompts_warm_pass_loads_as_many_tokens_with_hma_on_as_off(
    storage_dir: pathlib.Path,
) -> None:
    assert_block_aligned_prompts_load_as_many_tokens_with_hma_on_as_off(
        "SharedStorageConnector",
        lambda run: {"shared_storage_path": str(storage_dir / run)},
        settle=True,
    )


def test_a_request_with_a_tail_shorter_than_the_window_after_a_shared_prefix_hits_warm(
    storage_dir: pathlib.Path,
) -> None:
    assert_a_tail_shorter_than_the_window_after_a_shared_prefix_hits_warm(
        "SharedStorageConnector",
        lambda _run: {"shared_storage_path": str(storage_dir)},
        settle=True,
    )


class _GatedStore(DirectoryBlockStore):
    """Reads of one layout's keys wait for ``gate``: that group's load runs until the test says."""

    def __init__(self, root: pathlib.Path, gated: BlockLayout) -> None:
        super().__init__(root, entry_bytes=gated.entry_bytes)
        self.gated_prefix = gated.fingerprint_hex + "/"
        self.gate = threading.Event()

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        if keys[0].startswith(self.gated_prefix):
            assert self.gate.wait(30), "the test never opened the gate"
        return (yield from super().read_into_ranges(keys, ranges_per_key, writes))


def test_a_requests_async_loads_in_two_groups_end_together(tmp_path: pathlib.Path) -> None:
    base = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=16, dtype="float32")
    layouts = (attrs.evolve(base, group="full"), attrs.evolve(base, group="sliding"))
    store = _GatedStore(tmp_path, layouts[0])
    producer_caches = [layout_caches(base, seed) for seed in (1, 2)]
    consumer_caches = [layout_caches(base, None) for _ in layouts]

    counters = Counters()

    def worker(caches: list[dict[str, torch.Tensor]]) -> DrivenHandler[StoreTransferHandler]:
        return DrivenHandler(
            StoreTransferHandler(
                store=store,
                layouts=layouts,
                memories=[BlockMemory(group, base, sorted(group)) for group in caches],
                io_threads=2,
                batch_blocks=2,
                max_save_bytes=8 * base.entry_bytes,
                counters=counters,
                medium="test",
            )
        )

    producer = worker(producer_caches)
    producer.save(
        [
            BlockTransfer(request_id="p", block_ids=(0, 1), block_hashes=HASHES, group=g)
            for g in (0, 1)
        ]
    )
    assert producer.wait_for_saves(30)
    producer.close()
    counters.take()
    consumer = worker(consumer_caches)
    try:
        consumer.start_loads(
            [],
            [
                BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES, group=g)
                for g in (0, 1)
            ],
        )
        # The sliding group's load ends; the full group's waits at the gate.
        deadline = time.monotonic() + 30
        loaded = 0.0
        while loaded < 2:
            loaded += counters.take().get("blocks_loaded", 0)
            assert time.monotonic() < deadline, "the ungated load never ended"
            time.sleep(0.005)
        assert consumer.is_busy("c")
        assert consumer.take_finished_loads() == set()
        store.gate.set()
        while not consumer.take_finished_loads():
            assert time.monotonic() < deadline, "the gated load never ended"
            time.sleep(0.005)
        assert not consumer.is_busy("c")
        for group in (0, 1):
            assert blocks_equal(producer_caches[group], [0, 1], consumer_caches[group], [2, 3])
    finally:
        store.gate.set()
        consumer.close()
