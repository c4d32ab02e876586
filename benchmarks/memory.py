"""Peak extra memory of a 1 GiB transfer through each built-in connector, against its size.

For CPU offload, shared storage and Redis (a redis-server started here), a
fresh process allocates paged caches holding 1 GiB of blocks (4 layers, 8 KV
heads of 128, float32, 16-token blocks: 512 KiB a block), takes its resident
set, builds the connector's worker side, saves every block in one step and
waits for the writes, then loads them all back in one step. The kernel's
high-water mark of the resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before the connector is built and again before the
load) minus the resident set before, minus the medium's own bytes when the
medium lives in the process (the CPU pool: it is the store, not staging), is
the extra memory of the save and of the load; over the transfer's bytes it is
the figure. The transfer size is the bound: a connector that stages the whole
transfer shows about 1, one with no staging proportional to the transfer a
small fraction (the goal). Page cache and the Redis server's memory
are outside the process and not counted.

Each connector runs first with its default ``kv_connector_extra_config``.
When that drops saves (a cap on saves in flight below the transfer), it runs
again with ``max_save_bytes_in_flight`` sized to the transfer, so the table shows
both what the defaults do with 1 GiB and what a whole 1 GiB transfer costs.

``python -m benchmarks.memory [--quick]`` (128 MiB) or ``python -m benchmarks
--only memory``; writes ``memory.json`` into the output directory. Linux only.
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import pathlib
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from benchmarks.common import MIB, write_json
from benchmarks.common import main as run_from_command_line

GIB = 1024 * MIB
# The connectors benchmark's model: one token of every layer is 32 KiB.
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_TOKENS = 4, 8, 128, 16
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_TOKENS * NUM_KV_HEADS * HEAD_SIZE * 4
CONNECTORS = ("CPUOffloadConnector", "SharedStorageConnector", "RedisConnector")
SHORT_NAMES = {
    "CPUOffloadConnector": "cpu_offload",
    "SharedStorageConnector": "shared_storage",
    "RedisConnector": "redis",
}


# ------------------------------------------------------------ the kernel's counters


def resident_bytes(field: str = "VmRSS") -> int:
    """``field`` of ``/proc/self/status`` (VmRSS: resident now; VmHWM: its high-water mark)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux")


def reset_peak() -> None:
    """Restart the high-water mark (VmHWM) from the current resident set (Linux >= 4.0)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError as error:
        raise RuntimeError(
            f"cannot reset the resident-set peak through /proc/self/clear_refs ({error}): "
            "this benchmark needs Linux 4.0 or later with /proc writable"
        ) from error


class PeakMeter:
    """Resident bytes above those when it was made: now, and at their peak since then."""

    def __init__(self) -> None:
        reset_peak()
        self.before = resident_bytes()

    def now(self) -> int:
        return resident_bytes() - self.before

    def peak(self) -> int:
        return resident_bytes("VmHWM") - self.before


# ------------------------------------------------------------- one connector


def _hashes(count: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"memory:{i}".encode()).digest() for i in range(count))


def _metadata(connector: str, count: int, direction: str) -> Any:
    """One step's metadata moving blocks ``0..count-1`` (as benchmarks/connectors.py builds it)."""
    from kvwire.blocks.transfers import BlockTransfer
    from kvwire.connectors.offload.metadata import OffloadMetadata

    ids = tuple(range(count))
    pooled = connector == "CPUOffloadConnector"
    transfer = BlockTransfer(
        request_id="memory",
        block_ids=ids,
        block_hashes=_hashes(count),
        slots=ids if pooled else (),  # block i in pool slot i
    )
    if direction == "save":
        return OffloadMetadata(saves=(transfer,))
    return OffloadMetadata(loads=(transfer,))


def _counter(data: dict[str, Any], name: str) -> float:
    """``name`` summed over a stats tree."""
    return sum(
        _counter(value, name) if isinstance(value, dict) else value
        for key, value in data.items()
        if isinstance(value, dict) or (key == name and isinstance(value, int | float))
    )


def measure(
    connector: str, transfer_bytes: int, extra: dict[str, Any], medium_bytes: int = 0
) -> dict[str, Any]:
    """Save then load ``transfer_bytes`` of blocks through ``connector``: its peak extra memory.

    Run it in a fresh process (``run`` does): memory an earlier measurement
    freed to the allocator but not to the system would hide new allocations.
    """
    import torch

    from kvwire.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
    from kvwire.config.kv_cache import build_full_attention_kv_cache_config
    from kvwire.container import container_for_profile
    from kvwire.interface.base import KVConnectorRole
    from kvwire.interface.types import ForwardContext

    count = transfer_bytes // BLOCK_BYTES
    config = EngineConfig(
        model_config=ModelConfig(
            num_layers=NUM_LAYERS,
            num_attention_heads=NUM_KV_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
        ),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, num_gpu_blocks=count),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )
    kv_cache_config = build_full_attention_kv_cache_config(
        num_layers=NUM_LAYERS,
        num_blocks=count,
        block_size=BLOCK_TOKENS,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype="float32",
    )
    shape = (2, count, BLOCK_TOKENS, NUM_KV_HEADS, HEAD_SIZE)
    # Written now, so the caches are resident before the baseline is taken.
    caches = {name: torch.randn(shape) for name in kv_cache_config.layer_names}
    layers = tuple(caches)
    stats: dict[str, float] = {"saves_dropped": 0.0, "bytes_saved": 0.0, "bytes_loaded": 0.0}
    errors: set[int] = set()

    def step(metadata: Any) -> None:
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(ForwardContext(layer_names=layers))
        for layer in layers:
            worker.wait_for_layer_load(layer)
        worker.wait_for_save()
        errors.update(worker.get_block_ids_with_load_errors())
        worker.clear_connector_metadata()
        collect()

    def collect() -> None:
        taken = worker.get_kv_connector_stats()
        if taken is not None:
            for name in stats:
                stats[name] += _counter(taken.data, name)

    saving = PeakMeter()
    worker = container_for_profile(
        config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    ).connector()
    worker.register_kv_caches(caches)
    at_rest = saving.now()
    step(_metadata(connector, count, "save"))
    if not worker.wait_for_pending_saves(600):
        raise RuntimeError(f"{connector}: saves still running after 600 s")
    collect()
    save_extra = saving.peak()
    loading = PeakMeter()
    step(_metadata(connector, count, "load"))
    load_extra = loading.peak() + loading.before - saving.before
    worker.shutdown()
    saved = stats["bytes_saved"]
    # Both peaks are above the caches alone (the connector not yet built).
    extra_bytes = max(save_extra, load_extra) - medium_bytes
    return {
        "connector": connector,
        "extra_config": {key: str(value) for key, value in extra.items()},
        "transfer_bytes": count * BLOCK_BYTES,
        "blocks": count,
        "medium_bytes_in_process": medium_bytes,
        "resident_at_rest_bytes": at_rest,
        "save_peak_extra_bytes": save_extra - medium_bytes,
        "load_peak_extra_bytes": load_extra - medium_bytes,
        "peak_extra_bytes": extra_bytes,
        "peak_extra_ratio": extra_bytes / (count * BLOCK_BYTES),
        "saves_dropped": int(stats["saves_dropped"]),
        "bytes_saved": int(saved),
        "bytes_loaded": int(stats["bytes_loaded"]),
        "load_errors": len(errors),
    }


def _in_fresh_process(*args: Any) -> dict[str, Any]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        result: dict[str, Any] = pool.submit(measure, *args).result()
    return result


def pool_bytes(transfer_bytes: int) -> int:
    """A CPU pool just large enough for ``transfer_bytes`` of blocks (each entry has a header)."""
    from kvwire.blocks.format import BlockLayout

    entry = BlockLayout(NUM_LAYERS, BLOCK_TOKENS, NUM_KV_HEADS, HEAD_SIZE, "float32")
    return entry.entry_bytes * (transfer_bytes // BLOCK_BYTES)


def measure_connector(
    connector: str, transfer_bytes: int, scratch: pathlib.Path, redis_url: str | None
) -> list[dict[str, Any]]:
    """The defaults' row, and one with `max_save_bytes_in_flight` sized to the transfer.

    The second only where the defaults dropped saves.
    """
    medium = 0
    if connector == "CPUOffloadConnector":
        # A pool that holds the whole transfer; the pool is the medium.
        medium = pool_bytes(transfer_bytes)
        extra: dict[str, Any] = {"cpu_pool_bytes": medium}
    elif connector == "SharedStorageConnector":
        extra = {"shared_storage_path": str(scratch / "store")}
    else:
        assert redis_url is not None
        extra = {"url": redis_url}
    rows = [{"variant": "defaults", **_in_fresh_process(connector, transfer_bytes, extra, medium)}]
    _empty_medium(scratch, redis_url)
    if rows[0]["saves_dropped"]:
        sized = {**extra, "max_save_bytes_in_flight": transfer_bytes + transfer_bytes // 16}
        row = _in_fresh_process(connector, transfer_bytes, sized, medium)
        rows.append({"variant": "save cap sized to the transfer", **row})
        _empty_medium(scratch, redis_url)
    return rows


def _empty_medium(scratch: pathlib.Path, redis_url: str | None) -> None:
    shutil.rmtree(scratch / "store", ignore_errors=True)
    if redis_url is not None:
        import redis

        client = redis.Redis.from_url(redis_url)
        client.flushdb()
        client.close()


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| connector | config | transfer | resident at rest | save peak extra | "
        "load peak extra | peak extra / transfer | saves dropped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['connector']} | {row['variant']} | {row['transfer_bytes'] / MIB:.0f} MiB | "
            f"{row['resident_at_rest_bytes'] / MIB:.0f} MiB | "
            f"{row['save_peak_extra_bytes'] / MIB:.0f} MiB | "
            f"{row['load_peak_extra_bytes'] / MIB:.0f} MiB | {row['peak_extra_ratio']:.3f} | "
            f"{row['saves_dropped']} |"
        )
    return "\n".join(lines)


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    from benchmarks.redis import redis_server

    transfer_bytes = 128 * MIB if quick else GIB
    rows: list[dict[str, Any]] = []
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvwire-bench-memory-", dir=output_dir))
    try:
        for connector in CONNECTORS:
            if connector == "RedisConnector":
                with redis_server() as url:
                    found = measure_connector(connector, transfer_bytes, scratch, url)
            else:
                found = measure_connector(connector, transfer_bytes, scratch, None)
            for row in found:
                print(f"  {row}", flush=True)
            rows.extend(found)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_json(output_dir, "memory.json", {"quick": quick, "rows": rows})
    print(markdown_table(rows), flush=True)
    summary: dict[str, Any] = {}
    for row in rows:
        suffix = "" if row["variant"] == "defaults" else "_save_cap_sized"
        name = SHORT_NAMES[row["connector"]]
        summary[f"peak_extra_ratio_{name}{suffix}"] = round(row["peak_extra_ratio"], 3)
        if row["saves_dropped"]:
            summary[f"saves_dropped_{name}{suffix}"] = row["saves_dropped"]
    return summary


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line("python -m benchmarks.memory", run, argv)


if __name__ == "__main__":
    sys.exit(main())
