"""Redis throughput against plain redis-py pipelines of the same bytes, in one run.

For each block size (256 KiB to 8 MiB) the same payloads are written and read
back against one redis-server started here on loopback:

- the bound: the plain ``redis`` client (hiredis), ``SET``/``GET`` pipelines
  of ``bytes``, ``BATCH_BLOCKS`` blocks each; loads also with pipelines as
  large as the store's groups of GETs (``READ_GROUP_BYTES``), and the bound
  is the faster of the two, so that no ratio comes from a pipeline depth the
  plain client was not given;
- the store: :class:`~kvwire.media.store.redis.server.RedisBlockStore`, ``put``
  from memoryviews of one staging buffer in ``BATCH_BLOCKS`` blocks, and one
  ``get_into`` of each thread's share into preallocated buffers (which asks
  for its next group of GETs while it reads the current one);
- the connector: :class:`~kvwire.connectors.offload.RedisConnector`'s worker
  side over real paged caches (gather into staging, header and checksum,
  put; get, verify, scatter into the caches), ``batch_blocks`` =
  ``BATCH_BLOCKS``. It decides itself how to spread one transfer over its
  I/O threads: saves in jobs of ``BATCH_BLOCKS``, loads in one run per
  thread but no more runs than cores.

The plain client's ``SET`` packs each value into a new ``bytes`` (hiredis),
so its speed depends on the process's malloc state: 0.3-0.7 GB/s while glibc
serves such sizes from fresh mappings (``mmap``), up to the server's limit (about
1.3 GB/s on four threads) once it serves them from its heap, which it does
after the process has freed larger blocks (glibc's adaptive mmap threshold).

Everything runs twice: on one thread, and on the connector's default number
of I/O threads (``THREAD_COUNTS``). At each count, all three run on as many
threads (the plain client and the store with a connection per thread, the
connector with that many I/O threads), so the ratios measure what kvwire
adds or saves, not a difference in concurrency. Each figure is the best of a
few repeats, the paths taking turns so that noise from other processes hits
them alike.

``python -m benchmarks.redis [--quick]`` or ``python -m benchmarks --only redis``;
writes ``redis.json`` and ``redis.png`` into the output directory.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import redis

from benchmarks.common import KIB, MIB, best_seconds, pyplot, run_step, size_label, write_json
from benchmarks.common import main as run_from_command_line
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvwire.config.kv_cache import build_full_attention_kv_cache_config
from kvwire.connectors.offload import RedisConnector
from kvwire.connectors.offload.metadata import OffloadMetadata
from kvwire.container import container_for_profile
from kvwire.media.store.redis.cluster import RedisClusterBlockStore
from kvwire.media.store.redis.server import READ_GROUP_BYTES, RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings

BLOCK_SIZES = (256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB)
QUICK_BLOCK_SIZES = (256 * KIB, 1 * MIB, 8 * MIB)
BATCH_BLOCKS = 8
# One thread, and the store-backed connectors' default io_threads.
THREAD_COUNTS = (1, 4)
# The connector's model: one token of every layer is 32 KiB
# (4 layers x keys and values x 8 KV heads x 128 x float32).
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = 4, 8, 128
TOKEN_BYTES = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_SIZE * 4


@contextmanager
def redis_server() -> Iterator[str]:
    """A throw-away redis-server (or valkey-server) on a free loopback port; yields its URL."""
    executable = shutil.which("redis-server") or shutil.which("valkey-server")
    if executable is None:
        raise RuntimeError("redis-server not found: run `make redis-server` first")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvwire-bench-redis-")
    process = subprocess.Popen(
        [
            executable,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--protected-mode",
            "yes",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)


class BatchWork:
    """``count`` blocks of ``block_bytes`` in pipelines of ``BATCH_BLOCKS``, a share of the
    batches per thread, and what a thread does with its share, the plain client's way and the
    store's: the same keys and bytes either way, so their times compare. ``new_pipeline``
    opens the plain client's pipeline (a single server's or a cluster's)."""

    def __init__(
        self,
        new_pipeline: Callable[[], Any],
        store: RedisBlockStore | RedisClusterBlockStore,
        block_bytes: int,
        count: int,
        threads: int,
    ) -> None:
        self._new_pipeline = new_pipeline
        self._store = store
        self._block_bytes = block_bytes
        self._keys = [f"bench:{block_bytes}:{index}" for index in range(count)]
        # One staging buffer, as a connector has: the store sends slices of it.
        staging = bytearray(count * block_bytes)
        pattern = os.urandom(block_bytes)
        for index in range(count):
            staging[index * block_bytes : (index + 1) * block_bytes] = pattern
        whole = memoryview(staging)
        self._views = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]
        self._values = [bytes(view) for view in self._views]  # what a plain client user holds
        self._load_buffers = [memoryview(bytearray(block_bytes)) for _ in range(count)]
        batches = [
            range(start, min(start + BATCH_BLOCKS, count))
            for start in range(0, count, BATCH_BLOCKS)
        ]
        # Each thread takes every threads-th batch, on a connection of its own.
        self.shares = [batches[first::threads] for first in range(threads)]

    def plain_save(self, share: list[range]) -> None:
        for batch in share:
            pipeline = self._new_pipeline()
            for index in batch:
                pipeline.set(self._keys[index], self._values[index])
            pipeline.execute()

    def plain_load(self, share: list[range]) -> None:
        for batch in share:
            pipeline = self._new_pipeline()
            for index in batch:
                pipeline.get(self._keys[index])
            for value in pipeline.execute():
                assert len(value) == self._block_bytes

    def store_save(self, share: list[range]) -> None:
        for batch in share:
            keys = [self._keys[i] for i in batch]
            assert all(self._store.put(keys, [self._views[i] for i in batch]))

    def store_load(self, share: list[range]) -> None:
        indices = [index for batch in share for index in batch]
        keys = [self._keys[i] for i in indices]
        sizes = self._store.get_into(keys, [self._load_buffers[i] for i in indices])
        assert all(size == self._block_bytes for size in sizes)

    def loaded_what_was_saved(self) -> bool:
        """Whether the store's loads filled the buffers with the saved bytes (the first two)."""
        return all(buffer.tobytes() == self._values[0] for buffer in self._load_buffers[:2])


class _ConnectorPath:
    """RedisConnector's worker side over real paged caches: gather, header, checksum, I/O.

    ``threads`` I/O threads, pipelines of ``BATCH_BLOCKS`` blocks: the same
    shape of work as the plain client's loop, plus everything the connector adds.
    """

    def __init__(self, url: str, block_bytes: int, count: int, threads: int) -> None:
        import torch

        config = EngineConfig(
            model_config=ModelConfig(
                num_layers=NUM_LAYERS,
                num_attention_heads=NUM_KV_HEADS,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
            ),
            cache_config=CacheConfig(block_size=block_bytes // TOKEN_BYTES, num_gpu_blocks=count),
            kv_transfer_config=KVTransferConfig(
                kv_connector="RedisConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "url": url,
                    "key_prefix": "bench-connector:",
                    "io_threads": threads,
                    "batch_blocks": BATCH_BLOCKS,
                    # The whole transfer is one step's save: the worker copies it
                    # out of the cache at once and drops what finds no slot.
                    "max_save_bytes_in_flight": count * (block_bytes + 4096),
                },
            ),
        )
        kv_cache_config = build_full_attention_kv_cache_config(
            num_layers=NUM_LAYERS,
            num_blocks=count,
            block_size=config.cache_config.block_size,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype="float32",
        )
        shape = (2, count, config.cache_config.block_size, NUM_KV_HEADS, HEAD_SIZE)
        self.caches = {name: torch.randn(shape) for name in kv_cache_config.layer_names}
        # Built as an engine builds it: the container builds the medium it hands the connector.
        container = container_for_profile(config, kv_cache_config=kv_cache_config)
        connector = container.worker_connector()
        assert isinstance(connector, RedisConnector)
        self.connector = connector
        self.connector.register_kv_caches(self.caches)
        self.layers = tuple(self.caches)
        block_hashes = tuple(
            hashlib.sha256(f"bench:{block_bytes}:{index}".encode()).digest()
            for index in range(count)
        )
        self.transfer = BlockTransfer(
            request_id="bench", block_ids=tuple(range(count)), block_hashes=block_hashes
        )

    def save(self, _repeat: int = 0) -> None:
        run_step(self.connector, OffloadMetadata(saves=(self.transfer,)), self.layers)
        self.connector.wait_for_pending_saves()

    def load(self, _repeat: int = 0) -> None:
        run_step(self.connector, OffloadMetadata(loads=(self.transfer,)), self.layers)

    def close(self) -> None:
        self.connector.shutdown()


def measure_block_size(
    url: str, block_bytes: int, total_bytes: int, repeats: int, threads: int
) -> dict[str, Any]:
    count = max(BATCH_BLOCKS * threads, total_bytes // block_bytes)
    # Plain GET pipelines as deep as the store's groups of GETs, on the same shares.
    group_blocks = max(1, READ_GROUP_BYTES // block_bytes)
    wide_shares = [
        [
            range(start, min(start + group_blocks, count))
            for start in range(first * group_blocks, count, threads * group_blocks)
        ]
        for first in range(threads)
    ]
    pool = ThreadPoolExecutor(threads)
    plain = redis.Redis(
        connection_pool=redis.BlockingConnectionPool.from_url(url, max_connections=threads)
    )
    store = RedisBlockStore(RedisStoreSettings(url=url, key_prefix="", pool_size=threads))
    connector = _ConnectorPath(url, block_bytes, count, threads)
    work = BatchWork(lambda: plain.pipeline(transaction=False), store, block_bytes, count, threads)

    def on_every_thread(
        each: Callable[[list[range]], None], thread_shares: list[list[range]] = work.shares
    ) -> None:
        list(pool.map(each, thread_shares))

    def flush() -> None:
        plain.flushdb()

    def plain_save(_repeat: int = 0) -> None:
        on_every_thread(work.plain_save)

    def plain_load(_repeat: int = 0) -> None:
        on_every_thread(work.plain_load)

    def plain_load_wide(_repeat: int = 0) -> None:
        on_every_thread(work.plain_load, wide_shares)

    def store_save(_repeat: int = 0) -> None:
        on_every_thread(work.store_save)

    def store_load(_repeat: int = 0) -> None:
        on_every_thread(work.store_load)

    moved = count * block_bytes
    saves = {"plain_save": plain_save, "store_save": store_save, "connector_save": connector.save}
    seconds = best_seconds(saves, repeats, before_each=flush)
    plain_save()
    connector.save()
    loads = {
        "plain_load": plain_load,
        "plain_load_wide": plain_load_wide,
        "store_load": store_load,
        "connector_load": connector.load,
    }
    seconds.update(best_seconds(loads, repeats))
    assert work.loaded_what_was_saved()
    flush()
    plain.close()
    store.close()
    connector.close()
    pool.shutdown()
    gbps = {name: moved / value / 1e9 for name, value in seconds.items()}
    load_bound = max(gbps["plain_load"], gbps["plain_load_wide"])
    return {
        "threads": threads,
        "block_bytes": block_bytes,
        "blocks": count,
        "bytes_moved": moved,
        "gb_per_s": gbps,
        "save_ratio": gbps["store_save"] / gbps["plain_save"],
        "load_bound_gb_per_s": load_bound,
        "load_ratio": gbps["store_load"] / load_bound,
        "connector_save_ratio": gbps["connector_save"] / gbps["plain_save"],
        "connector_load_ratio": gbps["connector_load"] / load_bound,
    }


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    sizes = QUICK_BLOCK_SIZES if quick else BLOCK_SIZES
    total_bytes = (32 if quick else 128) * MIB
    repeats = 2 if quick else 6
    with redis_server() as url:
        rows = [
            measure_block_size(url, size, total_bytes, repeats, threads)
            for threads in THREAD_COUNTS
            for size in sizes
        ]
    write_json(output_dir, "redis.json", {"batch_blocks": BATCH_BLOCKS, "rows": rows})
    _plot(rows, output_dir / "redis.png")
    summary: dict[str, Any] = {}
    for row in rows:
        label = f"{row['block_bytes'] // KIB}KiB_{row['threads']}thread"
        summary[f"save_ratio_{label}"] = round(row["save_ratio"], 3)
        summary[f"load_ratio_{label}"] = round(row["load_ratio"], 3)
        summary[f"connector_save_ratio_{label}"] = round(row["connector_save_ratio"], 3)
        summary[f"connector_load_ratio_{label}"] = round(row["connector_load_ratio"], 3)
    for threads in THREAD_COUNTS:
        at_count = [row for row in rows if row["threads"] == threads]
        for figure in ("save_ratio", "load_ratio", "connector_save_ratio", "connector_load_ratio"):
            summary[f"min_{figure}_{threads}thread"] = round(
                min(row[figure] for row in at_count), 3
            )
    return summary


def _plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    plt = pyplot()
    styles = {
        "plain_save": (f"redis-py SET pipeline, {BATCH_BLOCKS} blocks (bound)", "C0", "--"),
        "store_save": ("kvwire RedisBlockStore.put", "C0", "-"),
        "plain_load": (f"redis-py GET pipeline, {BATCH_BLOCKS} blocks (bound)", "C1", "--"),
        "plain_load_wide": (
            f"redis-py GET pipeline, {READ_GROUP_BYTES // MIB} MiB (bound)",
            "C1",
            "-.",
        ),
        "store_load": ("kvwire RedisBlockStore.get_into", "C1", "-"),
        "connector_save": ("RedisConnector save (gather, header, checksum, put)", "C0", ":"),
        "connector_load": ("RedisConnector load (get, verify, scatter)", "C1", ":"),
    }
    figure, axes = plt.subplots(1, len(THREAD_COUNTS), figsize=(13, 4.8), sharey=True)
    for axis, threads in zip(axes, THREAD_COUNTS, strict=True):
        at_count = [row for row in rows if row["threads"] == threads]
        sizes_kib = [row["block_bytes"] // KIB for row in at_count]
        for name, (label, color, line) in styles.items():
            axis.plot(
                sizes_kib,
                [row["gb_per_s"][name] for row in at_count],
                line,
                color=color,
                marker="o",
                label=label,
            )
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes_kib, [size_label(row["block_bytes"]) for row in at_count])
        axis.set_xlabel("block size")
        axis.set_ylabel("GB/s (loopback)")
        axis.set_title(f"{threads} thread{'s' if threads > 1 else ''} on each side")
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle("Redis: kvwire vs plain redis-py pipelines, same server, same run")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line("python -m benchmarks.redis", run, argv)


if __name__ == "__main__":
    sys.exit(main())
