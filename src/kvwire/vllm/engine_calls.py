"""Calls an application makes on a vLLM ``LLM`` served by KVWireConnector.

:func:`kvwire_stats`: kvwire's counters since the engine started (vLLM's own
stats interval takes them step by step; this keeps the totals).

:func:`wait_for_saves`: waiting for saves that outlive a ``generate()`` call.

kvwire's connectors save in the background: when ``LLM.generate()`` returns,
the last steps' saves may still run, and a connector that keeps a finished
request's blocks while its save reads them (CPU offload) confirms the save
only once the engine steps again. The engine's own loop does that when vLLM
runs its engine core in a process of its own (the default); an in-process
engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only inside ``generate()``.
:func:`wait_for_saves` settles both, so that the next lookup finds every block
saved so far (call it before ``llm.reset_prefix_cache()``, which cannot free
blocks a save still holds).
"""

from __future__ import annotations

import time
from typing import Any


def wait_for_saves(llm: Any, timeout_s: float = 60.0) -> None:
    """Block until every save started by ``llm``'s KVWireConnector is complete and confirmed.

    Raises ``TimeoutError`` if that takes longer than ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    settled = llm.collective_rpc(_wait_on_worker, args=(timeout_s,))
    if not all(settled):
        raise TimeoutError(f"kvwire: saves still running after {timeout_s} s")
    engine = llm.llm_engine
    in_process_core = getattr(engine.engine_core, "engine_core", None)
    if in_process_core is None:
        return  # the engine core's own loop confirms them
    # Step the in-process engine until no finished request holds blocks for a save.
    while in_process_core.scheduler.has_requests() and not engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvwire: saves not confirmed after {timeout_s} s")
        engine.step()


def kvwire_stats(llm: Any) -> dict[str, int | float]:
    """kvwire's counters since ``llm`` started, flattened (``<child>.<counter>`` for composites)."""
    totals: list[dict[str, int | float]] = llm.collective_rpc(_totals_on_worker)
    merged: dict[str, int | float] = {}
    for worker_totals in totals:
        for name, value in worker_totals.items():
            merged[name] = merged.get(name, 0) + value
    return merged


def _totals_on_worker(worker: Any) -> dict[str, int | float]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    totals = getattr(get_kv_transfer_group(), "stats_totals", None)
    return {} if totals is None else dict(totals())


def _wait_on_worker(worker: Any, timeout_s: float) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return True
    connector = get_kv_transfer_group()
    wait = getattr(connector, "wait_for_pending_saves", None)
    return True if wait is None else bool(wait(timeout_s))
