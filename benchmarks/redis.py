"""Redis store throughput against plain redis-py pipelines of the same bytes.

For each block size (256 KiB to 8 MiB) the same payloads are written and read
back twice against one redis-server started here on loopback: once with the
plain ``redis`` client (hiredis, ``SET``/``GET`` pipelines of ``bytes``: the
bound), once through :class:`~kvwire.connectors.redis_store.RedisBlockStore`
(``put`` from memoryviews of one staging buffer, ``get_into`` preallocated
buffers). Both run one pipeline of ``batch_blocks`` blocks at a time on one
thread, so the figure is the store's overhead, not a difference in
concurrency. Each figure is the best of a few repeats, the two clients taking
turns so that noise from other processes hits both alike.

``python -m benchmarks.redis [--quick]`` or ``python -m benchmarks --only redis``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kvwire.connectors.redis_settings import RedisStoreSettings
from kvwire.connectors.redis_store import RedisBlockStore

KIB = 1024
MIB = 1024 * KIB
BLOCK_SIZES = (256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB)
QUICK_BLOCK_SIZES = (256 * KIB, 1 * MIB, 8 * MIB)
BATCH_BLOCKS = 8


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


def _best_seconds(
    actions: dict[str, Callable[[], None]], repeats: int, reset: Callable[[], None]
) -> dict[str, float]:
    """The best time of each action; the actions take turns, so noise hits them alike."""
    best = dict.fromkeys(actions, float("inf"))
    for _ in range(repeats):
        for name, action in actions.items():
            reset()
            started = time.perf_counter()
            action()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def measure_block_size(
    url: str, block_bytes: int, total_bytes: int, repeats: int
) -> dict[str, Any]:
    count = max(BATCH_BLOCKS, total_bytes // block_bytes)
    keys = [f"bench:{block_bytes}:{index}" for index in range(count)]
    # One staging buffer, as a connector has: the store sends slices of it.
    staging = bytearray(count * block_bytes)
    pattern = os.urandom(block_bytes)
    for index in range(count):
        staging[index * block_bytes : (index + 1) * block_bytes] = pattern
    whole = memoryview(staging)
    views = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]
    values = [bytes(view) for view in views]  # what a plain client user would hold
    load_buffers = [memoryview(bytearray(block_bytes)) for _ in range(count)]
    batches = [
        range(start, min(start + BATCH_BLOCKS, count)) for start in range(0, count, BATCH_BLOCKS)
    ]

    plain = redis.Redis.from_url(url)
    store = RedisBlockStore(RedisStoreSettings(url=url, key_prefix="", pool_size=2))

    def flush() -> None:
        plain.flushdb()

    def plain_save() -> None:
        for batch in batches:
            pipeline = plain.pipeline(transaction=False)
            for index in batch:
                pipeline.set(keys[index], values[index])
            pipeline.execute()

    def plain_load() -> None:
        for batch in batches:
            pipeline = plain.pipeline(transaction=False)
            for index in batch:
                pipeline.get(keys[index])
            for value in pipeline.execute():
                assert len(value) == block_bytes

    def store_save() -> None:
        for batch in batches:
            assert all(store.put([keys[i] for i in batch], [views[i] for i in batch]))

    def store_load() -> None:
        for batch in batches:
            sizes = store.get_into([keys[i] for i in batch], [load_buffers[i] for i in batch])
            assert all(size == block_bytes for size in sizes)

    def nothing() -> None:
        return None

    moved = count * block_bytes
    seconds = _best_seconds({"plain_save": plain_save, "store_save": store_save}, repeats, flush)
    plain_save()
    loads = {"plain_load": plain_load, "store_load": store_load}
    seconds.update(_best_seconds(loads, repeats, nothing))
    assert all(buffer.tobytes() == pattern for buffer in load_buffers[:2])
    flush()
    plain.close()
    store.close()
    gbps = {name: moved / value / 1e9 for name, value in seconds.items()}
    return {
        "block_bytes": block_bytes,
        "blocks": count,
        "bytes_moved": moved,
        "gb_per_s": gbps,
        "save_ratio": gbps["store_save"] / gbps["plain_save"],
        "load_ratio": gbps["store_load"] / gbps["plain_load"],
    }


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    sizes = QUICK_BLOCK_SIZES if quick else BLOCK_SIZES
    total_bytes = (32 if quick else 128) * MIB
    repeats = 2 if quick else 4
    with redis_server() as url:
        rows = [measure_block_size(url, size, total_bytes, repeats) for size in sizes]
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "redis.json").write_text(
        json.dumps({"batch_blocks": BATCH_BLOCKS, "rows": rows}, indent=2)
    )
    _plot(rows, output_dir / "redis.png")
    summary: dict[str, Any] = {}
    for row in rows:
        label = f"{row['block_bytes'] // KIB}KiB"
        summary[f"save_ratio_{label}"] = round(row["save_ratio"], 3)
        summary[f"load_ratio_{label}"] = round(row["load_ratio"], 3)
    summary["min_save_ratio"] = round(min(row["save_ratio"] for row in rows), 3)
    summary["min_load_ratio"] = round(min(row["load_ratio"] for row in rows), 3)
    return summary


def _plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes_kib = [row["block_bytes"] // KIB for row in rows]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    styles = {
        "plain_save": ("redis-py SET pipeline (bound)", "C0", "--"),
        "store_save": ("kvwire RedisBlockStore.put", "C0", "-"),
        "plain_load": ("redis-py GET pipeline (bound)", "C1", "--"),
        "store_load": ("kvwire RedisBlockStore.get_into", "C1", "-"),
    }
    for name, (label, color, line) in styles.items():
        axis.plot(
            sizes_kib,
            [row["gb_per_s"][name] for row in rows],
            line,
            color=color,
            marker="o",
            label=label,
        )
    axis.set_xscale("log", base=2)
    axis.set_xticks(
        sizes_kib, [f"{size} KiB" if size < 1024 else f"{size // 1024} MiB" for size in sizes_kib]
    )
    axis.set_xlabel("block size")
    axis.set_ylabel("GB/s (one thread, loopback)")
    axis.set_title("Redis: kvwire store vs plain redis-py pipelines, same server, same run")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.redis")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks/results")
    )
    args = parser.parse_args(argv)
    print(json.dumps(run(args.output_dir, args.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
