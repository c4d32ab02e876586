"""What the optional MAC key costs: the same work with the xxh3 checksum only and with the MAC.

Two measurements, each a ratio of two figures taken in the same run, on the
same bytes, the two variants taking turns repeat by repeat:

1. Bare: sealing (``write_header``) and verifying (``verify_entry``) entries of
   64 KiB to 4 MiB, one thread, over a buffer of many entries (so that they
   come from memory, as a store's do, not from the CPU cache).
2. Through the shared-storage connector's worker side (staging, background
   I/O threads, files): save and load GB/s of 1 MiB and 256 KiB blocks, with
   and without ``mac_key_env``.

``python -m benchmarks.mac [--quick]`` or ``python -m benchmarks --only mac``;
writes ``mac.json`` into the output directory.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from benchmarks.common import KIB, MIB, best_seconds, write_json
from benchmarks.common import main as run_from_command_line
from benchmarks.connectors import (
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    READ_REPEAT,
    STORAGE_IO_THREADS,
    TOKEN_BYTES,
    engine_config,
    hashes,
    remove_files,
    store_actions,
    worker_connector,
)
from kvwire.blocks.format import BlockLayout, verify_entry, write_header
from kvwire.blocks.mac import EntryMac
from kvwire.connectors.offload import SharedStorageConnector

BARE_BLOCK_SIZES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
STORE_BLOCK_SIZES = (256 * KIB, 1 * MIB)
KEY_VARIABLE = "KVWIRE_BENCH_MAC_KEY"

EntryStep = Callable[[memoryview, BlockLayout, bytes], None]
"""``write_header`` or ``verify_entry``: one entry, its layout and its block hash."""


def layouts(block_bytes: int) -> tuple[BlockLayout, BlockLayout]:
    """The layout of ``block_bytes`` blocks, with the checksum only and sealed with a MAC."""
    plain = BlockLayout(NUM_LAYERS, block_bytes // TOKEN_BYTES, NUM_KV_HEADS, HEAD_SIZE, "float32")
    return plain, attrs.evolve(plain, mac=EntryMac(secrets.token_bytes(32), KEY_VARIABLE))


def bench_bare(block_bytes: int, total_bytes: int, repeats: int) -> dict[str, float]:
    """GB/s of payload sealed and verified, one thread, without and with the MAC."""
    count = max(4, total_bytes // block_bytes)
    block_hashes = hashes(count, "bare")
    plain, sealed = layouts(block_bytes)
    # Each variant its own entries (written in its own format), from memory.
    entries = {
        name: entry_views(layout, count) for name, layout in (("plain", plain), ("mac", sealed))
    }
    layout_of = {"plain": plain, "mac": sealed}

    def each_entry(step: EntryStep, name: str) -> Callable[[int], None]:
        def run(repeat: int) -> None:
            for entry, block_hash in zip(entries[name], block_hashes, strict=True):
                step(entry, layout_of[name], block_hash)

        return run

    seconds = {
        step_name: best_seconds({name: each_entry(step, name) for name in entries}, repeats)
        for step_name, step in (("seal", write_header), ("verify", verify_entry))
    }
    return with_and_without_mac(count * plain.payload_bytes, seconds)


def with_and_without_mac(nbytes: int, seconds: dict[str, dict[str, float]]) -> dict[str, float]:
    """GB/s of ``nbytes`` per step, checksum only and with the MAC, and the MAC's relative speed.

    ``seconds`` holds, by step, the best seconds of its "plain" and "mac" variants.
    """
    results: dict[str, float] = {}
    for step, by_variant in seconds.items():
        results[f"{step}_checksum_gbps"] = nbytes / by_variant["plain"] / 1e9
        results[f"{step}_mac_gbps"] = nbytes / by_variant["mac"] / 1e9
        results[f"{step}_mac_vs_checksum"] = by_variant["plain"] / by_variant["mac"]
    return results


def entry_views(layout: BlockLayout, count: int) -> list[memoryview]:
    """``count`` entries of random payload in one buffer (headers written by the first seal)."""
    size = layout.entry_bytes
    buffer = memoryview(bytearray(os.urandom(count * size)))
    return [buffer[i * size : (i + 1) * size] for i in range(count)]


@contextmanager
def mac_key_in_environment() -> Iterator[str]:
    """A fresh random key in ``KEY_VARIABLE`` for the connector to read; removed afterwards."""
    os.environ[KEY_VARIABLE] = secrets.token_hex(32)
    try:
        yield KEY_VARIABLE
    finally:
        del os.environ[KEY_VARIABLE]


def bench_store(
    block_bytes: int, total_bytes: int, repeats: int, scratch: pathlib.Path
) -> dict[str, float]:
    """Save and load GB/s of the shared-storage connector, without and with ``mac_key_env``."""
    block_tokens = block_bytes // TOKEN_BYTES
    count = max(4, total_bytes // block_bytes)
    nbytes = count * block_bytes
    actions: dict[str, dict[str, Callable[[int], None]]] = {"save": {}, "load": {}}
    connectors: list[SharedStorageConnector] = []
    stores: list[pathlib.Path] = []
    with mac_key_in_environment() as variable:
        for name, mac in (("plain", {}), ("mac", {"mac_key_env": variable})):
            store = scratch / f"{name}-{block_bytes}"
            extra = {
                "shared_storage_path": str(store),
                # Staging for every block: a save that found no free slot would be dropped.
                "max_save_bytes_in_flight": count * block_bytes + MIB,
                "io_threads": STORAGE_IO_THREADS,
                **mac,
            }
            config = engine_config("SharedStorageConnector", extra, block_tokens, count)
            connector, caches = worker_connector(SharedStorageConnector, config)
            assert isinstance(connector, SharedStorageConnector)
            actions["save"][name], actions["load"][name] = store_actions(
                connector, tuple(caches), count, "mac"
            )
            connectors.append(connector)
            stores.append(store)
    try:
        save = best_seconds(actions["save"], repeats, before_each=lambda: remove_files(*stores))
        remove_files(*stores)
        for save_action in actions["save"].values():
            save_action(READ_REPEAT)
        load = best_seconds(actions["load"], repeats)
    finally:
        for connector in connectors:
            connector.shutdown()
    return with_and_without_mac(nbytes, {"save": save, "load": load})


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    repeats = 3 if quick else 5
    torch.manual_seed(0)
    total = 32 * MIB if quick else 128 * MIB
    results: dict[str, Any] = {"quick": quick, "bare": [], "shared_storage": []}
    for block_bytes in BARE_BLOCK_SIZES:
        row = {"block_kib": block_bytes // KIB, **bench_bare(block_bytes, total, repeats)}
        results["bare"].append(row)
        print(f"  bare {row}", flush=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvwire-bench-mac-", dir=output_dir))
    try:
        for block_bytes in STORE_BLOCK_SIZES:
            row = {
                "block_kib": block_bytes // KIB,
                **bench_store(block_bytes, total, repeats, scratch),
            }
            results["shared_storage"].append(row)
            print(f"  shared storage {row}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_json(output_dir, "mac.json", results)
    bare, store = results["bare"], results["shared_storage"]
    return {
        "bare_seal_mac_vs_checksum_min": min(row["seal_mac_vs_checksum"] for row in bare),
        "bare_verify_mac_vs_checksum_min": min(row["verify_mac_vs_checksum"] for row in bare),
        "shared_storage_save_mac_vs_checksum_min": min(
            row["save_mac_vs_checksum"] for row in store
        ),
        "shared_storage_load_mac_vs_checksum_min": min(
            row["load_mac_vs_checksum"] for row in store
        ),
    }


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line("python -m benchmarks.mac", run, argv)


if __name__ == "__main__":
    sys.exit(main())
