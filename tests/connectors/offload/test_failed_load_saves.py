"""After a failed load, only KV computed from good context is ever saved.

A sync load and the rest of a prompt run in one step. When the load of a
block fails, the blocks computed after it in that step were computed from
that block's stale cache contents; the engine recomputes them, but had they
been saved, a later request would load wrong KV from the store. These tests
go through the real engine and compare tokens with an engine without a
connector.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any

import attrs
import pytest

from kvwire.blocks.format import BlockLayout, CorruptBlockError, verify_entry
from kvwire.config import EngineConfig
from kvwire.engine.block_hash import extend_block_hashes, root_hash
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.media.cpu_pool.pool_memory import PoolSlots
from tests.support.engines import (
    shared_storage,
    tiered_disk,
    tiny_config,
    with_connector,
)
from tests.support.media import name_another_block

BLOCK_SIZE = 4
PREFIX = tuple(range(10, 22))  # three full blocks
# The prefix, then two more full blocks and a token to compute.
EXTENDED = (*PREFIX, *range(40, 48), 99)
# The same prefix, extended otherwise.
OTHER = (*PREFIX, *range(60, 68), 98)


def request(name: str, prompt: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(request_id=name, prompt_token_ids=prompt, max_tokens=3)


def block_hash(config: EngineConfig, prompt: tuple[int, ...], index: int) -> bytes:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, BLOCK_SIZE, root_hash(config.model_config))
    return hashes[index]


def flip_a_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def corrupt_pool_entry(pool: PoolSlots, layout: BlockLayout, block: bytes) -> None:
    """Make the CPU pool slot that holds ``block`` name another block: a mixed-up slot."""
    # As the pool writes its entries: in this process's memory, no payload checksum.
    in_pool = attrs.evolve(layout, payload_checksum=False)
    for slot in range(pool.num_slots):
        with contextlib.suppress(CorruptBlockError):
            verify_entry(pool.entry(slot), in_pool, block)
            name_another_block(pool, slot)
            return
    raise AssertionError("no pool slot holds the block")


def reference_tokens(prompt: tuple[int, ...]) -> tuple[int, ...]:
    (output,) = LLMEngine(tiny_config()).generate([request("reference", prompt)])
    return output.output_token_ids


@pytest.fixture
def reference() -> tuple[int, ...]:
    return reference_tokens(EXTENDED)


def test_shared_storage_never_keeps_blocks_computed_after_a_failed_load(
    reference: tuple[int, ...], tmp_path: pathlib.Path
) -> None:
    config = shared_storage(tiny_config(block_size=BLOCK_SIZE), tmp_path)
    layout = BlockLayout.from_engine_config(config)

    def run(name: str, prompt: tuple[int, ...]) -> tuple[tuple[int, ...], dict[str, Any]]:
        with LLMEngine(config) as engine:  # a fresh engine: nothing cached locally
            (output,) = engine.generate([request(name, prompt)])
        return output.output_token_ids, dict(engine.connector_stats.data)

    run("prefix", PREFIX)
    second_block = block_hash(config, PREFIX, 1).hex()
    flip_a_byte(tmp_path / layout.fingerprint_hex / second_block[:2] / second_block)
    # Loads the prefix (its second block fails) and computes the rest in the same step.
    extended, stats = run("extended", EXTENDED)
    assert extended == reference
    assert stats["load_errors"] == 1
    assert stats["saves_skipped_after_failed_load"] == 2  # the two blocks after the prefix

    # The recomputed blocks were saved in that run: every block is a hit now,
    # and what the store holds is right.
    again, stats = run("extended again", EXTENDED)
    assert again == reference
    assert stats["blocks_loaded"] == len(EXTENDED) // BLOCK_SIZE
    assert "load_errors" not in stats


def test_the_cpu_pool_never_keeps_blocks_computed_after_a_failed_load(
    reference: tuple[int, ...],
) -> None:
    config = with_connector(
        tiny_config(block_size=BLOCK_SIZE), "CPUOffloadConnector", {"cpu_pool_bytes": "4MiB"}
    )
    layout = BlockLayout.from_engine_config(config)
    with LLMEngine(config) as engine:

        def run(name: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
            engine.reset_prefix_cache()  # what was computed comes back from the pool
            (output,) = engine.generate([request(name, prompt)])
            engine.wait_for_saves()
            return output.output_token_ids

        run("prefix", PREFIX)
        pool = engine.worker.connector._worker.handler.pool  # type: ignore[union-attr]
        corrupt_pool_entry(pool, layout, block_hash(config, PREFIX, 1))
        assert run("extended", EXTENDED) == reference
        stats = dict(engine.connector_stats.data)
        assert stats["load_errors"] == 1
        assert stats["saves_skipped_after_failed_load"] == 2

        # Only blocks computed from good context were stored: loading them all is right.
        assert run("extended again", EXTENDED) == reference
        assert engine.connector_stats.data["blocks_loaded"] > stats["blocks_loaded"]


def test_the_tiered_profile_saves_nothing_computed_after_the_cpu_pool_failed_a_load(
    reference: tuple[int, ...], tmp_path: pathlib.Path
) -> None:
    # The CPU pool loads; shared storage, which did not load, saves too: it
    # must leave out what was computed after the pool's failed load.
    config = tiered_disk(tiny_config(block_size=BLOCK_SIZE), tmp_path)
    layout = BlockLayout.from_engine_config(config)
    with LLMEngine(config) as engine:
        engine.generate([request("prefix", PREFIX)])
        engine.wait_for_saves()
        engine.reset_prefix_cache()
        cpu_child = engine.worker.connector._children[0]  # type: ignore[union-attr]
        corrupt_pool_entry(cpu_child._worker.handler.pool, layout, block_hash(config, PREFIX, 1))
        (extended,) = engine.generate([request("extended", EXTENDED)])
        engine.wait_for_saves()
        stats = engine.connector_stats.data
    assert extended.output_token_ids == reference
    # Both tiers left out the two blocks computed in the failed load's step
    # (and saved them once computed again).
    assert stats["CPUOffloadConnector"]["saves_skipped_after_failed_load"] == 2
    assert stats["SharedStorageConnector"]["saves_skipped_after_failed_load"] == 2

    # A new engine, its pool empty, finds every block on disk: they must be right.
    disk_only = shared_storage(tiny_config(block_size=BLOCK_SIZE), tmp_path)
    with LLMEngine(disk_only) as engine:
        (again,) = engine.generate([request("extended again", EXTENDED)])
    assert again.output_token_ids == reference
    assert again.external_tokens == 5 * BLOCK_SIZE  # every full block, from disk


def test_a_request_sharing_the_failed_block_as_a_prefix_saves_none_of_it() -> None:
    # Two requests of one step share a prefix one of them loads. When the load
    # of its second block fails, the loading request computed its next blocks
    # from it; the other waits for the load to be known sound (a step), then
    # shares the recomputed blocks, so it has nothing to leave unsaved.
    config = with_connector(
        tiny_config(block_size=BLOCK_SIZE), "CPUOffloadConnector", {"cpu_pool_bytes": "4MiB"}
    )
    layout = BlockLayout.from_engine_config(config)
    with LLMEngine(config) as engine:
        engine.generate([request("prefix", PREFIX)])
        engine.wait_for_saves()
        engine.reset_prefix_cache()
        pool = engine.worker.connector._worker.handler.pool  # type: ignore[union-attr]
        corrupt_pool_entry(pool, layout, block_hash(config, PREFIX, 1))
        together = engine.generate([request("extended", EXTENDED), request("other", OTHER)])
        engine.wait_for_saves()
        stats = dict(engine.connector_stats.data)
        engine.reset_prefix_cache()
        (other_again,) = engine.generate([request("other again", OTHER)])

    assert [output.output_token_ids for output in together] == [
        reference_tokens(EXTENDED),
        reference_tokens(OTHER),
    ]
    assert stats["saves_skipped_after_failed_load"] == 2  # the loading request's two blocks
    assert other_again.output_token_ids == reference_tokens(OTHER)
    assert other_again.external_tokens == 5 * BLOCK_SIZE  # all of it from the pool
