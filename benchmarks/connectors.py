"""Throughput of the built-in connectors against the machine's bound for the same bytes.

Three measurements, each in one run:

1. Save and load GB/s of the CPU-offload and shared-storage connectors'
   worker sides for block sizes from 64 KiB to 4 MiB (the size of one stored
   block: every layer's keys and values), driven through their real worker
   calls over real paged caches. Bounds, measured here on the same bytes: a
   torch copy into a preallocated buffer (CPU pool); a plain write and read of
   one file per block in the same filesystem (shared storage), from and into
   a buffer as large as the connector's staging, on as many threads as the
   connector's I/O threads. Files of earlier repeats (the connector's and the
   bound's) are removed, untimed, before each save, so that neither writes
   into a page cache fuller of dirty pages than the other. Beside the CPU
   pool, a reference that only checksums each block and then copies it
   (``checksum_then_copy_gbps``): what a load that checksums before copying
   (a store's, a peer's) costs on this machine, whatever its design; the CPU
   pool itself checks only each header.
2. vLLM's ExampleConnector strategy (one safetensors file per layer
   per request, synchronous) on the same requests as the shared-storage
   connector: the ratio of their throughputs.
3. Time to first token on long shared prompts through the engine, warm CPU
   offload against no connector.

Each throughput is the best of a few repeats. ``python -m benchmarks.connectors
[--quick]`` or ``python -m benchmarks --only connectors``; writes
``connectors.json`` and ``connectors.png`` into the output directory.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch
import xxhash
from dependency_injector import providers

from benchmarks.common import KIB, MIB, best_seconds, pyplot, run_step, size_label, write_json
from benchmarks.common import main as run_from_command_line
from kvwire.blocks.format import BlockLayout
from kvwire.blocks.paged_cache import copy_on_this_thread_only
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvwire.config.kv_cache import build_full_attention_kv_cache_config
from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.connectors.offload.metadata import OffloadMetadata
from kvwire.container import container_for_profile
from kvwire.interface.base import KVConnectorBase, KVConnectorRole

BLOCK_SIZES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
# One token of every layer is 32 KiB: 4 layers x (keys + values) x 8 heads x 128 x fp32.
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = 4, 8, 128
TOKEN_BYTES = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_SIZE * 4
# Best of this many repeats (5 in a full run): a shared machine is noisy.
REPEATS = 3
# The CPU-offload connector's default copy threads per direction.
CPU_OFFLOAD_IO_THREADS = 2
# The shared-storage connector's default I/O threads per direction; the plain
# file bound runs on as many threads.
STORAGE_IO_THREADS = 4


def engine_config(
    connector: str, extra: dict[str, Any], block_tokens: int, blocks: int
) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(
            num_layers=NUM_LAYERS,
            num_attention_heads=NUM_KV_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
        ),
        cache_config=CacheConfig(block_size=block_tokens, num_gpu_blocks=blocks),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )


def worker_connector(
    cls: type[KVConnectorBase], config: EngineConfig
) -> tuple[KVConnectorBase, dict[str, torch.Tensor]]:
    model = config.model_config
    kv_cache_config = build_full_attention_kv_cache_config(
        num_layers=model.num_layers,
        num_blocks=config.cache_config.num_gpu_blocks,
        block_size=config.cache_config.block_size,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        dtype=model.dtype,
    )
    shape = (2, kv_cache_config.num_blocks, config.cache_config.block_size, NUM_KV_HEADS, HEAD_SIZE)
    caches = {name: torch.randn(shape) for name in kv_cache_config.layer_names}
    # Built as an application builds it, so an offload connector is handed its medium.
    container = container_for_profile(
        config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    )
    container.connector_class.override(providers.Object(cls))
    connector = container.connector()
    connector.register_kv_caches(caches)
    return connector, caches


def hashes(count: int, salt: str) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(count))


def best_gbps(
    nbytes: int, *actions: Callable[[int], None], before_each: Callable[[], None] | None = None
) -> list[float]:
    """GB/s of the fastest of ``REPEATS`` calls of each action, taking turns (see best_seconds)."""
    named = {str(index): action for index, action in enumerate(actions)}
    seconds = best_seconds(named, REPEATS, before_each)
    return [nbytes / seconds[name] / 1e9 for name in named]


# ------------------------------------------------------------------ CPU pool


def bench_cpu_offload(block_bytes: int, total_bytes: int) -> dict[str, float]:
    block_tokens = block_bytes // TOKEN_BYTES
    count = max(4, total_bytes // block_bytes)
    layout_bytes = BlockLayout(
        NUM_LAYERS, block_tokens, NUM_KV_HEADS, HEAD_SIZE, "float32"
    ).entry_bytes
    config = engine_config(
        "CPUOffloadConnector",
        {"cpu_pool_bytes": layout_bytes * count},
        block_tokens,
        count,
    )
    connector, caches = worker_connector(CPUOffloadConnector, config)
    assert isinstance(connector, CPUOffloadConnector)
    layers = tuple(caches)
    transfer = BlockTransfer(
        request_id="bench",
        block_ids=tuple(range(count)),
        slots=tuple(range(count)),
        block_hashes=hashes(count, "cpu"),
    )
    nbytes = count * block_bytes

    def save(repeat: int) -> None:
        run_step(connector, OffloadMetadata(saves=(transfer,)), layers)
        connector.wait_for_pending_saves()

    def load(repeat: int) -> None:
        run_step(connector, OffloadMetadata(loads=(transfer,)), layers)

    # The bound: the same bytes (every layer's cache) copied by torch into a
    # preallocated buffer of the same size: same memory footprint, one call per layer.
    target = torch.empty((len(layers), *caches[layers[0]].shape))

    def copy(repeat: int) -> None:
        for index, layer in enumerate(layers):
            target[index].copy_(caches[layer])

    checked_copy = checksum_then_copy_action(count, block_bytes)
    save_gbps, load_gbps, bound, ceiling = best_gbps(nbytes, save, load, copy, checked_copy)
    connector.shutdown()
    return {
        "save_gbps": save_gbps,
        "load_gbps": load_gbps,
        "bound_gbps": bound,
        "checksum_then_copy_gbps": ceiling,
    }


def checksum_then_copy_action(count: int, block_bytes: int) -> Callable[[int], None]:
    """What any load that verifies before it copies must do, and nothing more.

    Each block's bytes are checksummed (xxh3, as the connector's format) and
    then copied with torch, on as many threads as the CPU pool's copy
    threads, each copying on its own: no headers, no bookkeeping, contiguous
    blocks. Its ratio to the bound shows how much of the gap to a single copy
    is the checksum pass itself on this machine.
    """
    source = torch.randn(count, block_bytes // 4)
    target = torch.empty_like(source)
    views = [memoryview(block.numpy()).cast("B") for block in source]
    threads = CPU_OFFLOAD_IO_THREADS
    pool = ThreadPoolExecutor(threads, initializer=copy_on_this_thread_only)
    shares = [range(i, count, threads) for i in range(threads)]

    def share(blocks: range) -> None:
        for index in blocks:
            xxhash.xxh3_64(views[index]).intdigest()
            target[index].copy_(source[index])

    def run(repeat: int) -> None:
        list(pool.map(share, shares))

    return run


# ------------------------------------------------------------ shared storage


def plain_file_actions(
    directory: pathlib.Path, count: int, entry_bytes: int, threads: int
) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """A plain write of new files, and a plain read of them, one file per block.

    The same bytes as the connector moves: ``count`` distinct entries in one
    buffer of the connector's staging size (not one small buffer that stays
    in the CPU cache), on as many threads as the connector's I/O threads.
    """
    directory.mkdir()
    source = bytearray(os.urandom(count * entry_bytes))
    target = bytearray(count * entry_bytes)
    sources, targets = memoryview(source), memoryview(target)
    pool = ThreadPoolExecutor(threads)
    shares = [range(i, count, threads) for i in range(threads)]

    def write_share(repeat: int, share: range) -> None:
        for i in share:
            with open(directory / f"plain-{repeat}-{i}", "wb") as file:
                file.write(sources[i * entry_bytes : (i + 1) * entry_bytes])

    def read_share(repeat: int, share: range) -> None:
        for i in share:
            with open(directory / f"plain-{repeat}-{i}", "rb", buffering=0) as file:
                file.readinto(targets[i * entry_bytes : (i + 1) * entry_bytes])

    def write(repeat: int) -> None:
        list(pool.map(lambda share: write_share(repeat, share), shares))

    def read(repeat: int) -> None:
        list(pool.map(lambda share: read_share(READ_REPEAT, share), shares))

    return write, read


# The repeat whose files both loads read: written, untimed, after the saves.
READ_REPEAT = -1


def remove_files(*roots: pathlib.Path) -> None:
    """Delete what earlier repeats wrote, untimed, so that dirty pages do not pile up.

    Otherwise each repeat would write into a page cache fuller than the last,
    and throttled write-back would weigh on whichever action runs later.
    """
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                os.unlink(os.path.join(folder, name))


def store_actions(
    connector: SharedStorageConnector, layers: tuple[str, ...], count: int, salt: str
) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """A save of ``count`` blocks, and a load of those the ``READ_REPEAT`` save stored."""

    def transfer(repeat: int) -> BlockTransfer:
        # New blocks every repeat: new files, as a store sees in service.
        return BlockTransfer(
            request_id="bench",
            block_ids=tuple(range(count)),
            block_hashes=hashes(count, f"{salt}-{repeat}"),
        )

    def save(repeat: int) -> None:
        run_step(connector, OffloadMetadata(saves=(transfer(repeat),)), layers)
        connector.wait_for_pending_saves()

    def load(repeat: int) -> None:
        run_step(connector, OffloadMetadata(loads=(transfer(READ_REPEAT),)), layers)

    return save, load


def bench_shared_storage(
    block_bytes: int, total_bytes: int, scratch: pathlib.Path
) -> dict[str, float]:
    block_tokens = block_bytes // TOKEN_BYTES
    count = max(4, total_bytes // block_bytes)
    store = scratch / f"store-{block_bytes}"
    config = engine_config(
        "SharedStorageConnector",
        # Room for every block's save in flight: a save beyond the cap would be dropped.
        {
            "shared_storage_path": str(store),
            "max_save_bytes_in_flight": count * block_bytes + MIB,
            "io_threads": STORAGE_IO_THREADS,
        },
        block_tokens,
        count,
    )
    connector, caches = worker_connector(SharedStorageConnector, config)
    assert isinstance(connector, SharedStorageConnector)
    nbytes = count * block_bytes
    save, load = store_actions(connector, tuple(caches), count, "disk")
    plain = scratch / f"plain-{block_bytes}"
    write, read = plain_file_actions(plain, count, connector.layout.entry_bytes, STORAGE_IO_THREADS)
    save_gbps, write_bound = best_gbps(
        nbytes, save, write, before_each=lambda: remove_files(store, plain)
    )
    remove_files(store, plain)
    save(READ_REPEAT)
    write(READ_REPEAT)
    load_gbps, read_bound = best_gbps(nbytes, load, read)
    connector.shutdown()
    shutil.rmtree(plain)
    shutil.rmtree(store)
    return {
        "save_gbps": save_gbps,
        "load_gbps": load_gbps,
        "write_bound_gbps": write_bound,
        "read_bound_gbps": read_bound,
    }


# ------------------------------------------------- the example connector's way


def bench_example_strategy(
    requests: int, blocks_per_request: int, block_bytes: int, scratch: pathlib.Path
) -> dict[str, float]:
    """One safetensors file per layer per request, synchronous, against shared storage."""
    from safetensors.torch import load_file, save_file

    block_tokens = block_bytes // TOKEN_BYTES
    count = requests * blocks_per_request
    config = engine_config(
        "SharedStorageConnector",
        {
            "shared_storage_path": str(scratch / "kvwire"),
            "max_save_bytes_in_flight": count * block_bytes + MIB,
        },
        block_tokens,
        count,
    )
    connector, caches = worker_connector(SharedStorageConnector, config)
    assert isinstance(connector, SharedStorageConnector)
    layers = tuple(caches)
    per_request = [
        list(range(r * blocks_per_request, (r + 1) * blocks_per_request)) for r in range(requests)
    ]

    def transfers(repeat: int) -> tuple[BlockTransfer, ...]:
        return tuple(
            BlockTransfer(
                request_id=f"r{r}",
                block_ids=tuple(ids),
                block_hashes=hashes(len(ids), f"example-{repeat}-{r}"),
            )
            for r, ids in enumerate(per_request)
        )

    nbytes = count * block_bytes
    folder = scratch / "example"

    # Both write new files on every repeat and read the last repeat's files.
    def example_save(repeat: int) -> None:
        for r, ids in enumerate(per_request):
            index = torch.tensor(ids)
            request_folder = folder / f"{repeat}" / f"request-{r}"
            request_folder.mkdir(parents=True, exist_ok=True)
            for layer, cache in caches.items():
                save_file(
                    {"kv_cache": cache[:, index].contiguous()},
                    str(request_folder / f"{layer}.safetensors"),
                )

    def example_load(repeat: int) -> None:
        for r, ids in enumerate(per_request):
            index = torch.tensor(ids)
            for layer, cache in caches.items():
                path = folder / f"{REPEATS - 1}" / f"request-{r}" / f"{layer}.safetensors"
                cache[:, index] = load_file(str(path))["kv_cache"]

    blocking_s: list[float] = []

    def kvwire_save(repeat: int) -> None:
        started = time.perf_counter()
        run_step(connector, OffloadMetadata(saves=transfers(repeat)), layers)
        # What the forward pass waits for: the copy into staging, not the writes.
        blocking_s.append(time.perf_counter() - started)
        connector.wait_for_pending_saves()

    def kvwire_load(repeat: int) -> None:
        run_step(connector, OffloadMetadata(loads=transfers(REPEATS - 1)), layers)

    example_save_gbps, kvwire_save_gbps = best_gbps(nbytes, example_save, kvwire_save)
    example_load_gbps, kvwire_load_gbps = best_gbps(nbytes, example_load, kvwire_load)
    figures = {
        "example_save_gbps": example_save_gbps,
        "example_load_gbps": example_load_gbps,
        "shared_storage_save_gbps": kvwire_save_gbps,
        "shared_storage_load_gbps": kvwire_load_gbps,
    }
    connector.shutdown()
    # The example connector writes synchronously: the forward pass waits for all of it.
    figures["example_forward_pass_wait_s"] = nbytes / (example_save_gbps * 1e9)
    figures["shared_storage_forward_pass_wait_s"] = min(blocking_s)
    figures["forward_pass_wait_ratio"] = (
        figures["example_forward_pass_wait_s"] / figures["shared_storage_forward_pass_wait_s"]
    )
    figures["save_ratio"] = figures["shared_storage_save_gbps"] / figures["example_save_gbps"]
    figures["load_ratio"] = figures["shared_storage_load_gbps"] / figures["example_load_gbps"]
    return figures


# ------------------------------------------------------------------- TTFT


def bench_time_to_first_token(quick: bool, scratch: pathlib.Path) -> dict[str, float]:
    """Warm CPU offload and shared storage against no connector on long shared prompts.

    Every measured pass runs in an engine that has already run a pass (its
    first kernels are paid for), with the local prefix cache emptied.
    """
    from kvwire.engine.engine import LLMEngine
    from kvwire.engine.presets import apply_preset
    from kvwire.engine.workload import WorkloadSpec, synthetic_workload

    base = apply_preset(
        EngineConfig(cache_config=CacheConfig(block_size=16, num_gpu_blocks=1024)), "bench"
    )
    spec = WorkloadSpec(
        num_requests=4 if quick else 8,
        prompt_len=512 if quick else 1536,
        output_len=4,
        shared_prefix_ratio=0.9,
        vocab_size=base.model_config.vocab_size,
        seed=11,
    )
    requests = synthetic_workload(spec)
    warm_up = synthetic_workload(attrs.evolve(spec, seed=spec.seed + 1))

    def again(suffix: str) -> list[Any]:
        return [attrs.evolve(r, request_id=r.request_id + suffix) for r in requests]

    with LLMEngine(base) as engine:
        engine.generate(requests)
        engine.reset_prefix_cache()
        plain = engine.generate(again("-measured"))
    offload = attrs.evolve(
        base,
        kv_transfer_config=KVTransferConfig(
            kv_connector="CPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_pool_bytes": "512MiB"},
        ),
    )
    with LLMEngine(offload) as engine:
        engine.generate(requests)  # cold: fills the pool
        engine.reset_prefix_cache()
        warm = engine.generate(again("-warm"))
    storage = attrs.evolve(
        base,
        kv_transfer_config=KVTransferConfig(
            kv_connector="SharedStorageConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(scratch / "ttft")},
        ),
    )
    with LLMEngine(storage) as engine:
        engine.generate(requests)  # a producer engine fills the directory
    with LLMEngine(storage) as engine:  # a second engine reads it
        engine.generate(warm_up)
        from_disk = engine.generate(again("-disk"))
    for outputs in (warm, from_disk):
        if [o.output_token_ids for o in plain] != [o.output_token_ids for o in outputs]:
            raise RuntimeError("warm outputs differ from outputs without a connector")

    def p50(outputs: list[Any]) -> float:
        return float(statistics.median(o.time_to_first_token_s for o in outputs))

    return {
        "no_connector_ttft_p50_s": p50(plain),
        "warm_cpu_offload_ttft_p50_s": p50(warm),
        "ttft_speedup": p50(plain) / p50(warm),
        "warm_shared_storage_ttft_p50_s": p50(from_disk),
        "shared_storage_ttft_speedup": p50(plain) / p50(from_disk),
        "prompt_tokens": spec.prompt_len,
        "served_from_connector_tokens": sum(o.external_tokens for o in warm),
    }


# --------------------------------------------------------------------- run


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()
    sizes = [row["block_kib"] for row in results["cpu_offload"]]
    figure, (cpu, disk) = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, key, series in (
        (
            cpu,
            "cpu_offload",
            (
                ("save_gbps", "save"),
                ("load_gbps", "load"),
                ("bound_gbps", "torch copy (bound)"),
                ("checksum_then_copy_gbps", "checksum then copy"),
            ),
        ),
        (
            disk,
            "shared_storage",
            (
                ("save_gbps", "save"),
                ("load_gbps", "load"),
                ("write_bound_gbps", "plain write (bound)"),
                ("read_bound_gbps", "plain read (bound)"),
            ),
        ),
    ):
        for field, label in series:
            style = "--" if "bound" in field else ":" if "then" in field else "-"
            axis.plot(sizes, [row[field] for row in results[key]], style, marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [size_label(size * KIB) for size in sizes])
        axis.set_xlabel("block size")
        axis.set_ylabel("GB/s")
        axis.set_title(key.replace("_", " "))
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    global REPEATS
    REPEATS = 3 if quick else 5
    torch.manual_seed(0)
    total = 32 * MIB if quick else 128 * MIB
    results: dict[str, Any] = {"quick": quick, "cpu_offload": [], "shared_storage": []}
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvwire-bench-connectors-", dir=output_dir))
    try:
        for block_bytes in BLOCK_SIZES:
            row = {"block_kib": block_bytes // KIB}
            cpu = bench_cpu_offload(block_bytes, total)
            results["cpu_offload"].append({**row, **cpu})
            disk = bench_shared_storage(block_bytes, total, scratch)
            results["shared_storage"].append({**row, **disk})
            print(f"  {block_bytes // KIB:>5} KiB  cpu {cpu}  disk {disk}", flush=True)
        results["example_strategy"] = bench_example_strategy(
            requests=4 if quick else 8, blocks_per_request=8, block_bytes=1 * MIB, scratch=scratch
        )
        print(f"  example strategy {results['example_strategy']}", flush=True)
        results["time_to_first_token"] = bench_time_to_first_token(quick, scratch)
        print(f"  time to first token {results['time_to_first_token']}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_json(output_dir, "connectors.json", results)
    plot(results, output_dir / "connectors.png")
    large = [i for i, size in enumerate(BLOCK_SIZES) if size >= MIB]
    cpu_rows, disk_rows = results["cpu_offload"], results["shared_storage"]
    return {
        "cpu_offload_save_vs_copy_min_at_1MiB_up": min(
            cpu_rows[i]["save_gbps"] / cpu_rows[i]["bound_gbps"] for i in large
        ),
        "cpu_offload_load_vs_copy_min_at_1MiB_up": min(
            cpu_rows[i]["load_gbps"] / cpu_rows[i]["bound_gbps"] for i in large
        ),
        "checksum_then_copy_vs_copy_min_at_1MiB_up": min(
            cpu_rows[i]["checksum_then_copy_gbps"] / cpu_rows[i]["bound_gbps"] for i in large
        ),
        "shared_storage_save_vs_plain_write_min_at_1MiB_up": min(
            disk_rows[i]["save_gbps"] / disk_rows[i]["write_bound_gbps"] for i in large
        ),
        "shared_storage_load_vs_plain_read_min_at_1MiB_up": min(
            disk_rows[i]["load_gbps"] / disk_rows[i]["read_bound_gbps"] for i in large
        ),
        "shared_storage_vs_example_connector_save": results["example_strategy"]["save_ratio"],
        "shared_storage_vs_example_connector_load": results["example_strategy"]["load_ratio"],
        "example_connector_forward_pass_wait_vs_shared_storage": results["example_strategy"][
            "forward_pass_wait_ratio"
        ],
        "warm_cpu_offload_ttft_speedup": results["time_to_first_token"]["ttft_speedup"],
        "warm_shared_storage_ttft_speedup": results["time_to_first_token"][
            "shared_storage_ttft_speedup"
        ],
    }


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line("python -m benchmarks.connectors", run, argv)


if __name__ == "__main__":
    sys.exit(main())
