"""Redis Cluster throughput: kvwire against plain redis-py ``RedisCluster`` pipelines, in one run.

A cluster of 1, then 3, masters (no replicas: a replica would copy every
write on the same two cores) is started here on loopback with
``--cluster-enabled yes`` and ``CLUSTER ADDSLOTSRANGE``/``MEET``. On each,
for each block size, the same payloads are written and read back by:

- the bound: redis-py's ``RedisCluster`` (hiredis), pipelines of
  ``BATCH_BLOCKS`` ``SET``/``GET`` of ``bytes`` (the client splits each by
  master itself), ``THREADS`` threads;
- the store: :class:`~kvwire.media.store.redis.cluster.RedisClusterBlockStore`,
  ``put`` of memoryviews of one staging buffer in ``BATCH_BLOCKS`` blocks and
  ``get_into`` of each thread's share, ``THREADS`` threads;
- the connector: :class:`~kvwire.connectors.offload.RedisConnector`'s worker
  side over real paged caches (gather, header, checksum, put; get, verify,
  scatter) with ``THREADS`` I/O threads, as in :mod:`benchmarks.redis`.

The ratios (kvwire / plain, same cluster, same run) say what kvwire adds or
saves. The 1 vs 3 masters figures say how the paths scale with masters; on
one machine with two cores the servers compete with the client for the
same cores, so they show the client's overhead per master, not the gain of
spreading a fleet over machines, where each master brings its own cores and
network card.

``python -m benchmarks.redis_cluster [--quick]`` or ``python -m benchmarks
--only redis-cluster``; writes ``redis-cluster.json`` into the output directory.
"""

from __future__ import annotations

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
from redis.cluster import RedisCluster

from benchmarks.common import KIB, MIB, best_seconds, write_json
from benchmarks.common import main as run_from_command_line
from benchmarks.redis import BATCH_BLOCKS, BatchWork, _ConnectorPath
from kvwire.media.store.redis.cluster import RedisClusterBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings

BLOCK_SIZES = (256 * KIB, 1 * MIB, 4 * MIB)
QUICK_BLOCK_SIZES = (256 * KIB, 1 * MIB)
MASTER_COUNTS = (1, 3)
# The store-backed connectors' default io_threads.
THREADS = 4
_SLOTS = 16384
_START_TIMEOUT_S = 30.0


@contextmanager
def redis_cluster(masters: int) -> Iterator[list[redis.Redis]]:
    """``masters`` cluster-enabled servers on loopback owning all slots; yields a client of each."""
    executable = shutil.which("redis-server") or shutil.which("valkey-server")
    if executable is None:
        raise RuntimeError("redis-server not found: run `make redis-server` first")
    workdir = tempfile.mkdtemp(prefix="kvwire-bench-cluster-")
    ports = _free_ports(masters)
    processes = [
        subprocess.Popen(
            [
                executable,
                *("--port", str(port), "--bind", "127.0.0.1"),
                *("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"),
                *("--save", "", "--appendonly", "no", "--dir", workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    clients = [redis.Redis(host="127.0.0.1", port=port, socket_timeout=10) for port in ports]
    try:
        _wait(lambda: all(_answers(client) for client in clients), "the servers to start")
        share = _SLOTS // masters
        for number, client in enumerate(clients):
            last = _SLOTS - 1 if number == masters - 1 else (number + 1) * share - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", number * share, last)
            for port in ports:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        _wait(lambda: all(_cluster_ok(client, masters) for client in clients), "cluster_state:ok")
        yield clients
    finally:
        for client in clients:
            client.close()
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)


def measure(
    url: str, clients: list[redis.Redis], block_bytes: int, total_bytes: int, repeats: int
) -> dict[str, Any]:
    count = max(BATCH_BLOCKS * THREADS, total_bytes // block_bytes)
    pool = ThreadPoolExecutor(THREADS)
    seeds = url.removeprefix("redis+cluster://").split(",")
    host, _, port = seeds[0].rpartition(":")
    plain = RedisCluster(host=host, port=int(port), protocol=2)
    store = RedisClusterBlockStore(
        RedisStoreSettings(url=url, key_prefix="bench-store:", pool_size=THREADS)
    )
    connector = _ConnectorPath(url, block_bytes, count, THREADS)
    work = BatchWork(plain.pipeline, store, block_bytes, count, THREADS)

    def on_every_thread(each: Callable[[list[range]], None]) -> None:
        list(pool.map(each, work.shares))

    def flush() -> None:
        for client in clients:
            client.flushall()

    saves = {
        "plain_save": lambda _repeat: on_every_thread(work.plain_save),
        "store_save": lambda _repeat: on_every_thread(work.store_save),
        "connector_save": connector.save,
    }
    seconds = best_seconds(saves, repeats, before_each=flush)
    saves["plain_save"](0)
    saves["store_save"](0)
    connector.save()
    loads = {
        "plain_load": lambda _repeat: on_every_thread(work.plain_load),
        "store_load": lambda _repeat: on_every_thread(work.store_load),
        "connector_load": connector.load,
    }
    seconds.update(best_seconds(loads, repeats))
    assert work.loaded_what_was_saved()
    flush()
    plain.close()
    store.close()
    connector.close()
    pool.shutdown()
    moved = count * block_bytes
    gbps = {name: moved / value / 1e9 for name, value in seconds.items()}
    return {
        "block_bytes": block_bytes,
        "blocks": count,
        "bytes_moved": moved,
        "gb_per_s": gbps,
        "store_save_ratio": gbps["store_save"] / gbps["plain_save"],
        "store_load_ratio": gbps["store_load"] / gbps["plain_load"],
        "connector_save_ratio": gbps["connector_save"] / gbps["plain_save"],
        "connector_load_ratio": gbps["connector_load"] / gbps["plain_load"],
    }


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    sizes = QUICK_BLOCK_SIZES if quick else BLOCK_SIZES
    total_bytes = (32 if quick else 64) * MIB
    repeats = 2 if quick else 4
    rows = []
    for masters in MASTER_COUNTS:
        with redis_cluster(masters) as clients:
            ports = [client.connection_pool.connection_kwargs["port"] for client in clients]
            url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)
            for size in sizes:
                rows.append(
                    {"masters": masters, **measure(url, clients, size, total_bytes, repeats)}
                )
    write_json(
        output_dir,
        "redis-cluster.json",
        {"batch_blocks": BATCH_BLOCKS, "threads": THREADS, "cores": os.cpu_count(), "rows": rows},
    )
    summary: dict[str, Any] = {}
    for row in rows:
        label = f"{row['block_bytes'] // KIB}KiB_{row['masters']}master"
        for figure in ("connector_save_ratio", "connector_load_ratio"):
            summary[f"{figure}_{label}"] = round(row[figure], 3)
        for path in ("plain_save", "plain_load", "connector_save", "connector_load"):
            summary[f"{path}_gb_per_s_{label}"] = round(row["gb_per_s"][path], 3)
    for size in sizes:
        one, three = (
            next(row for row in rows if row["masters"] == n and row["block_bytes"] == size)
            for n in MASTER_COUNTS
        )
        for path in ("plain_save", "plain_load", "connector_save", "connector_load"):
            summary[f"{path}_3_vs_1_master_{size // KIB}KiB"] = round(
                three["gb_per_s"][path] / one["gb_per_s"][path], 3
            )
    return summary


def _free_ports(count: int) -> list[int]:
    """Loopback ports free now, each with its cluster bus port (+10000) free too."""
    ports: list[int] = []
    probes = []
    try:
        while len(ports) < count:
            probe = socket.socket()
            probes.append(probe)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
            if port + 10000 <= 65535 and _is_free(port + 10000):
                ports.append(port)
    finally:
        for probe in probes:
            probe.close()
    return ports


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _cluster_ok(client: redis.Redis, masters: int) -> bool:
    info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text and f"cluster_known_nodes:{masters}" in text


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line("python -m benchmarks.redis_cluster", run, argv)


if __name__ == "__main__":
    sys.exit(main())
