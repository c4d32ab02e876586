"""A load that fails leaves nothing in the KV cache: its blocks are zero before the engine knows.

Store media read an entry straight into its cache block and verify it there,
so a forged entry's bytes reach the block before they are refused. The
worker half zeroes every failed block, every layer, keys and values, before
it reports the failure: the engine, which computes the block again and may
give it to another request as a partly filled last block, never reads them.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvwire.blocks.format import HEADER_SIZE
from tests.support.pairs import ConnectorPair, PairFactory, make_request

MAC_VARIABLE = "KVWIRE_TEST_SCRUB_MAC_KEY"
PROMPT = list(range(200, 217))  # 4 full blocks of 4 tokens, and one to compute
SOURCE_BLOCKS = [1, 2, 3, 4, 5]
TARGET_BLOCKS = [11, 12, 13, 14, 15]
FULL_BLOCKS = 4


@pytest.fixture
def mac_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(MAC_VARIABLE, "0123456789abcdef" * 4)
    return MAC_VARIABLE


def overwrite_payloads_keeping_headers(storage_dir: pathlib.Path, byte: int) -> int:
    """As a writer without the MAC key: every entry's payload replaced, its header kept."""
    entries = [path for path in storage_dir.rglob("*") if path.is_file()]
    for path in entries:
        entry = bytearray(path.read_bytes())
        entry[HEADER_SIZE:] = bytes([byte]) * (len(entry) - HEADER_SIZE)
        path.write_bytes(entry)
    return len(entries)


def saved(pair: ConnectorPair) -> None:
    request = make_request("writer", PROMPT, pair.block_size)
    pair.prefill(request, SOURCE_BLOCKS)
    pair.finish(request, SOURCE_BLOCKS)


def zero_blocks(caches: dict[str, torch.Tensor], block_ids: list[int]) -> bool:
    return all(bool((cache[:, block_ids] == 0).all()) for cache in caches.values())


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("byte", [0xFF, 0x7F], ids=["0xff", "0x7f"])
def test_every_block_of_a_refused_forged_load_is_zero_when_the_failure_is_reported(
    shared_storage_pair: PairFactory,
    storage_dir: pathlib.Path,
    mac_key: str,
    load_async: bool,
    byte: int,
) -> None:
    writer = shared_storage_pair(seed=1, mac_key_env=mac_key)
    saved(writer)
    assert overwrite_payloads_keeping_headers(storage_dir, byte) == FULL_BLOCKS
    # The reader's blocks hold NaN before the load: anything not zero afterwards was left.
    reader = shared_storage_pair(seed=2, mac_key_env=mac_key, async_load=load_async)
    for cache in reader.caches.values():
        cache.fill_(float("nan"))
    request = make_request("reader", PROMPT, reader.block_size)

    matched, is_async = reader.prefill(request, TARGET_BLOCKS)
    if is_async:
        reader.step_until(lambda: "reader" in reader.finished_recving)

    assert matched == FULL_BLOCKS * reader.block_size
    assert reader.load_errors == set(TARGET_BLOCKS[:FULL_BLOCKS])
    assert zero_blocks(reader.caches, TARGET_BLOCKS[:FULL_BLOCKS])
    assert reader.stats["load_blocks_scrubbed"] == FULL_BLOCKS
    # Only the failed blocks: the block past the loaded range keeps what it held.
    assert all(bool(cache[:, TARGET_BLOCKS[-1]].isnan().all()) for cache in reader.caches.values())


def test_a_load_that_succeeds_leaves_the_entries_bytes_and_scrubs_nothing(
    shared_storage_pair: PairFactory, mac_key: str
) -> None:
    writer = shared_storage_pair(seed=1, mac_key_env=mac_key)
    saved(writer)
    reader = shared_storage_pair(seed=2, mac_key_env=mac_key)
    request = make_request("reader", PROMPT, reader.block_size)

    reader.prefill(request, TARGET_BLOCKS)

    assert reader.load_errors == set()
    assert "load_blocks_scrubbed" not in reader.stats
    for name, cache in reader.caches.items():
        loaded = cache[:, TARGET_BLOCKS[:FULL_BLOCKS]]
        assert torch.equal(loaded, writer.caches[name][:, SOURCE_BLOCKS[:FULL_BLOCKS]])
