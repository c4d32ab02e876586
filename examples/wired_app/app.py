"""A wired application: a scheduler process and a worker process, each with its own container.

Each process builds a ``KVConnectorContainer`` from the same profile, declares
its role once, and wires this module, so the functions below get "this
process's connector" through ``Provide[KVConnectorContainer.connector]``
without knowing which role they run in. The scheduler side decides what to
save; its metadata crosses to the worker process by pickling; the worker side
copies the blocks out of its paged KV cache into files. The parent process
then checks every file byte for byte. Only the worker side (and that final
check) imports torch: the scheduler process never touches a tensor.

Run it from the repository root::

    .venv/bin/python examples/wired_app/app.py --workdir /tmp/kvwire-journal
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import attrs
from dependency_injector.wiring import Provide, inject

from kvwire import (
    EngineConfig,
    KVCacheConfig,
    KVConnectorBase,
    KVConnectorContainer,
    KVConnectorRole,
)
from kvwire.config.kv_cache import build_full_attention_kv_cache_config
from kvwire.config.profile import load_profile, unstructure_engine_config
from kvwire.container import container_for_profile
from kvwire.interface.types import ForwardContext, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    import torch

HERE = pathlib.Path(__file__).resolve().parent

# request id -> the blocks the engine allocated to it (one KV cache group).
REQUESTS: dict[str, list[int]] = {"request-a": [0, 1, 2], "request-b": [5, 3]}


def find_example_connector() -> None:
    """Let the profile's module path ("journal_connector") import from this folder.

    Connector classes are resolved lazily, when a container first builds a
    connector, so each process only needs this before that moment.
    """
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))


def shared_profile(journal_dir: pathlib.Path) -> dict[str, Any]:
    """The profile both processes use, with one engine_id fixed for both."""
    config = load_profile(HERE / "profile.yaml")
    transfer = config.kv_transfer_config
    assert transfer is not None
    extra = {**transfer.kv_connector_extra_config, "journal_dir": str(journal_dir)}
    transfer = attrs.evolve(transfer, kv_connector_extra_config=extra)
    return unstructure_engine_config(attrs.evolve(config, kv_transfer_config=transfer))


def sized_kv_cache(engine_config: EngineConfig) -> KVCacheConfig:
    model, cache = engine_config.model_config, engine_config.cache_config
    return build_full_attention_kv_cache_config(
        num_layers=model.num_layers,
        num_blocks=cache.num_gpu_blocks,
        block_size=cache.block_size,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        dtype=model.dtype,
    )


def paged_kv_caches(engine_config: EngineConfig) -> dict[str, torch.Tensor]:
    """One [2, blocks, block_size, kv_heads, head_size] tensor per layer, with known contents."""
    import torch  # only the worker and the final check touch tensors

    model, cache = engine_config.model_config, engine_config.cache_config
    shape = (2, cache.num_gpu_blocks, cache.block_size, model.num_kv_heads, model.head_size)
    count = 2 * cache.num_gpu_blocks * cache.block_size * model.num_kv_heads * model.head_size
    return {
        f"layers.{layer}.attn": (torch.arange(count, dtype=torch.float32) + layer * count).reshape(
            shape
        )
        for layer in range(model.num_layers)
    }


# ------------------------------------------------------- application code


@inject
def schedule_one_step(
    pipe: Connection, connector: KVConnectorBase = Provide[KVConnectorContainer.connector]
) -> dict[str, Any]:
    output = SchedulerOutput(
        scheduled=[
            ScheduledRequest(
                request_id=request_id,
                block_ids=(blocks,),
                num_computed_tokens=0,
                num_scheduled_tokens=len(blocks) * 4,
                is_new=True,
            )
            for request_id, blocks in REQUESTS.items()
        ]
    )
    pipe.send(connector.build_connector_meta(output))
    report: dict[str, Any] = pipe.recv()
    return report


@inject
def run_forward_pass(
    pipe: Connection,
    kv_caches: dict[str, torch.Tensor],
    connector: KVConnectorBase = Provide[KVConnectorContainer.connector],
) -> None:
    connector.register_kv_caches(kv_caches)
    connector.bind_connector_metadata(pipe.recv())
    connector.start_load_kv(ForwardContext(layer_names=tuple(kv_caches)))
    for layer_name, kv_cache in kv_caches.items():
        connector.wait_for_layer_load(layer_name)
        # The layer's attention would run here, writing this step's KV into kv_cache.
        connector.save_kv_layer(layer_name, kv_cache, None)
    connector.wait_for_save()
    connector.clear_connector_metadata()
    pipe.send({"worker_pid": os.getpid(), "role": connector.role.name})


# ------------------------------------------------------------- processes


def scheduler_process(
    profile: dict[str, Any], to_worker: Connection, to_parent: Connection
) -> None:
    find_example_connector()
    engine_config = load_profile(profile)
    container = container_for_profile(
        engine_config,
        role=KVConnectorRole.SCHEDULER,
        kv_cache_config=sized_kv_cache(engine_config),
    )
    container.wire(modules=[sys.modules[__name__]])
    try:
        report = schedule_one_step(to_worker)
        report.update(scheduler_pid=os.getpid(), scheduler_role=container.connector().role.name)
        to_parent.send(report)
    finally:
        container.unwire()
        container.shutdown_resources()


def worker_process(profile: dict[str, Any], pipe: Connection) -> None:
    find_example_connector()
    engine_config = load_profile(profile)
    container = container_for_profile(
        engine_config, role=KVConnectorRole.WORKER, kv_cache_config=sized_kv_cache(engine_config)
    )
    container.wire(modules=[sys.modules[__name__]])
    try:
        run_forward_pass(pipe, paged_kv_caches(engine_config))
    finally:
        container.unwire()
        container.shutdown_resources()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    journal_dir = args.workdir / "journal"
    profile = shared_profile(journal_dir)

    spawn = multiprocessing.get_context("spawn")
    scheduler_end, worker_end = spawn.Pipe()
    parent_end, report_end = spawn.Pipe()
    scheduler = spawn.Process(target=scheduler_process, args=(profile, scheduler_end, report_end))
    worker = spawn.Process(target=worker_process, args=(profile, worker_end))
    scheduler.start()
    worker.start()
    report = parent_end.recv() if parent_end.poll(120) else None
    scheduler.join(60)
    worker.join(60)
    if report is None or scheduler.exitcode != 0 or worker.exitcode != 0:
        print(f"failed: scheduler exit {scheduler.exitcode}, worker exit {worker.exitcode}")
        return 1

    engine_config = load_profile(profile)
    expected = paged_kv_caches(engine_config)
    checked = 0
    for request_id, blocks in REQUESTS.items():
        for layer_name, kv_cache in expected.items():
            saved = (journal_dir / request_id / f"{layer_name}.kv").read_bytes()
            if saved != kv_cache[:, blocks].contiguous().numpy().tobytes():
                print(f"failed: {request_id}/{layer_name} differs from the worker's KV cache")
                return 1
            checked += 1
    print(
        f"scheduler (pid {report['scheduler_pid']}, role {report['scheduler_role']}) and "
        f"worker (pid {report['worker_pid']}, role {report['role']}) ran in separate processes"
    )
    print(f"{checked} files saved by the worker match its KV cache byte for byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
