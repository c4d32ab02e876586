"""The peer medium's directory entries outlive their expiry while the pool holds the block: a
step of the holder announces them again, and its own lookup writes back one the directory lost.
On a real redis-server, with a one-second expiry."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvwire.blocks.format import BlockLayout
from kvwire.media.base import LoadSpec
from kvwire.media.peer._directory import FoundLocations, PeerDirectory
from kvwire.media.peer._index import PeerIndex
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.redis import RedisServer

LAYOUT = BlockLayout(num_layers=1, block_size=2, num_kv_heads=1, head_size=4, dtype="float32")
BLOCKS = [bytes([n]) * 32 for n in range(3)]
TTL_S = 1.0


@pytest.fixture
def directories(redis_server: RedisServer, key_prefix: str) -> Iterator[list[PeerDirectory]]:
    settings = RedisStoreSettings.from_extra_config(
        {"url": redis_server.url, "key_prefix": key_prefix}
    )
    made = [PeerDirectory(settings, TTL_S) for _ in range(2)]
    yield made
    for directory in made:
        directory.close()


def holding(directory: PeerDirectory) -> PeerIndex:
    """A peer whose pool holds ``BLOCKS``, announced."""
    index = PeerIndex(
        num_slots=4,
        fingerprints=[LAYOUT.fingerprint_hex],
        medium="peer",
        peer="holder",
        directory=directory,
    )
    assert len(index.prepare_save(0, BLOCKS)) == len(BLOCKS)
    index.complete_save(0, BLOCKS, success=True)
    return index


def reader(directory: PeerDirectory) -> PeerIndex:
    return PeerIndex(
        num_slots=1,
        fingerprints=[LAYOUT.fingerprint_hex],
        medium="peer",
        peer="reader",
        directory=directory,
    )


@pytest.mark.slow
def test_a_step_of_the_holder_announces_again_entries_about_to_expire(
    directories: list[PeerDirectory],
) -> None:
    holder, other = holding(directories[0]), reader(directories[1])
    assert other.count_held_prefix(0, BLOCKS) == len(BLOCKS)
    time.sleep(TTL_S * 0.6)
    holder.take_counters()  # a scheduler step, past half the expiry
    time.sleep(TTL_S * 0.6)
    # Past the first announcement's expiry: found thanks to the step's.
    assert other.count_held_prefix(0, BLOCKS) == len(BLOCKS)


@pytest.mark.slow
def test_an_entry_the_directory_lost_is_written_back_by_the_holders_lookup(
    directories: list[PeerDirectory],
) -> None:
    holder, other = holding(directories[0]), reader(directories[1])
    time.sleep(TTL_S * 1.2)
    assert other.count_held_prefix(0, BLOCKS) == 0  # expired: the holder had no step
    assert holder.count_held_prefix(0, BLOCKS) == len(BLOCKS)
    assert other.count_held_prefix(0, BLOCKS) == len(BLOCKS)


def test_an_evicted_block_is_neither_counted_nor_announced_again(
    directories: list[PeerDirectory],
) -> None:
    holder, other = holding(directories[0]), reader(directories[1])
    assert holder.reset()
    holder.take_counters()
    assert holder.count_held_prefix(0, BLOCKS) == 0
    assert other.count_held_prefix(0, BLOCKS) == 0


def test_a_lookups_locations_go_to_the_load_and_only_for_the_blocks_it_counted(
    directories: list[PeerDirectory],
) -> None:
    holding(directories[0])
    other = reader(directories[1])
    fingerprint = LAYOUT.fingerprint_hex
    announced = directories[1].look_up([directories[1].entry_key(fingerprint, b) for b in BLOCKS])
    missing = b"\xff" * 32
    assert other.count_held_prefix(0, [*BLOCKS, missing]) == len(BLOCKS)

    payload = other.prepare_load(0, [*BLOCKS, missing]).payload

    assert isinstance(payload, FoundLocations)
    assert list(payload.locations[:-1]) == announced
    assert {location.peer for location in announced if location} == {"holder"}
    assert payload.locations[-1] is None
    # The next lookup replaces what the load is given: nothing of another request's.
    assert other.count_held_prefix(0, [missing]) == 0
    assert other.prepare_load(0, BLOCKS) == LoadSpec()


def test_a_block_whose_entry_the_directory_lost_goes_to_the_load_from_the_pool(
    directories: list[PeerDirectory],
) -> None:
    holder = holding(directories[0])
    fingerprint = LAYOUT.fingerprint_hex
    keys = [directories[0].entry_key(fingerprint, b) for b in BLOCKS]
    announced = directories[0].look_up(keys)
    directories[0].withdraw([(k, a) for k, a in zip(keys, announced, strict=True) if a])
    assert holder.count_held_prefix(0, BLOCKS) == len(BLOCKS)

    payload = holder.prepare_load(0, BLOCKS).payload

    assert isinstance(payload, FoundLocations)
    assert list(payload.locations) == announced
