"""Damaged entries inside vLLM: a bad checksum is a load error vLLM recomputes; noise under a
valid checksum reaches the model (the negative control that proves loads are real)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import kvwire.vllm
from kvwire.blocks.format import HEADER_SIZE, BlockLayout, write_header
from tests.support.vllm import (
    generate,
    kvwire_transfer_config,
    profile_with_directory,
    running_llm,
    shared_prompts,
)

PROMPTS = shared_prompts()


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("corruption")


@pytest.fixture(scope="module")
def shared_storage_llm(tiny_model: str, store_root: pathlib.Path) -> Iterator[Any]:
    profile = profile_with_directory("shared-storage.yaml", store_root)
    with running_llm(tiny_model, kvwire_transfer_config(profile)) as llm:
        yield llm


def stored_entries(store_root: pathlib.Path) -> list[pathlib.Path]:
    return [path for path in store_root.rglob("*") if path.is_file() and len(path.name) == 64]


def rewrite_each_entry(store_root: pathlib.Path, change: Callable[[bytearray, bytes], None]) -> int:
    """Replace each entry by a changed copy (renamed into place: entries never change in place)."""
    entries = stored_entries(store_root)
    for path in entries:
        entry = bytearray(path.read_bytes())
        change(entry, bytes.fromhex(path.name))
        replacement = path.with_name(path.name + ".test")
        replacement.write_bytes(entry)
        os.chmod(replacement, 0o600)
        os.replace(replacement, path)
    return len(entries)


def engine_layout() -> BlockLayout:
    """The block layout of the KVWireConnector in this process (the in-process engine's worker)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return BlockLayout.from_engine_config(get_kv_transfer_group().container.engine_config())


def cold_pass_then_damage(llm: Any, store_root: pathlib.Path, change: Callable[..., None]) -> Any:
    # An earlier test's requests keep their blocks until their saves are confirmed.
    kvwire.vllm.wait_for_saves(llm)
    for path in stored_entries(store_root):
        path.unlink()
    assert llm.reset_prefix_cache()
    cold, _ = generate(llm, PROMPTS)
    kvwire.vllm.wait_for_saves(llm)
    assert rewrite_each_entry(store_root, change) > 0
    assert llm.reset_prefix_cache()
    return cold


def flip_one_payload_byte(entry: bytearray, block_hash: bytes) -> None:
    entry[HEADER_SIZE + 100] ^= 0xFF


@pytest.mark.slow
def test_corrupted_entry_is_recomputed_with_identical_outputs(
    shared_storage_llm: Any, store_root: pathlib.Path
) -> None:
    before = kvwire.vllm.kvwire_stats(shared_storage_llm).get("load_errors", 0)
    cold = cold_pass_then_damage(shared_storage_llm, store_root, flip_one_payload_byte)
    warm, _ = generate(shared_storage_llm, PROMPTS)
    stats = kvwire.vllm.kvwire_stats(shared_storage_llm)
    assert warm == cold
    assert stats.get("load_errors", 0) > before


@pytest.mark.slow
def test_noise_under_a_valid_checksum_changes_the_outputs(
    shared_storage_llm: Any, store_root: pathlib.Path
) -> None:
    layout = engine_layout()
    generator = torch.Generator().manual_seed(1)

    def replace_payload_with_noise(entry: bytearray, block_hash: bytes) -> None:
        noise = torch.randn(layout.payload_bytes // 4, generator=generator) * 3
        entry[HEADER_SIZE : HEADER_SIZE + layout.payload_bytes] = noise.numpy().tobytes()
        write_header(memoryview(entry), layout, block_hash)

    before = kvwire.vllm.kvwire_stats(shared_storage_llm)
    cold = cold_pass_then_damage(shared_storage_llm, store_root, replace_payload_with_noise)
    warm, _ = generate(shared_storage_llm, PROMPTS)
    after = kvwire.vllm.kvwire_stats(shared_storage_llm)
    assert after.get("load_errors", 0) == before.get("load_errors", 0)
    assert after["blocks_loaded"] > before.get("blocks_loaded", 0)
    assert warm != cold
