"""Calls an application makes on a vLLM `LLM` served by KVWireConnector.

Both reach the worker's connector through vLLM's worker RPC, so the `LLM`
must be started with `worker_extension_cls=WORKER_EXTENSION` (vLLM mixes
`kvwire.vllm.KVWireWorkerExtension` into its worker class, in whichever
process the worker runs).

`kvwire.vllm.kvwire_stats`: kvwire's counters since the engine started (vLLM's own
stats interval takes them step by step; this keeps the totals), summed over
the engine's KVWireConnectors: its connector, or those among the children of
vLLM's `MultiConnector`.

`kvwire.vllm.wait_for_saves`: kvwire's connectors save in the background: when
`LLM.generate()` returns, the last steps' saves may still run, and a
connector that keeps a finished request's blocks while its save reads them
(CPU offload) confirms the save only once the engine steps again. The engine
core's own loop does that when vLLM runs it in a process of its own (the
default); an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) steps
only inside `generate()`. `kvwire.vllm.wait_for_saves` settles both, so that the
next lookup finds every block saved so far (call it before
`llm.reset_prefix_cache()`, which cannot free blocks a save still holds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

from kvwire.common.redaction import shown
from kvwire.vllm.connector import KVWireConnector

WORKER_EXTENSION = "kvwire.vllm.engine_calls.KVWireWorkerExtension"


class KVWireWorkerExtension:
    """Worker methods vLLM's `collective_rpc` can call by name (vLLM's worker extension)."""

    def kvwire_wait_for_saves(self, timeout_s: float) -> bool:
        return all([c.wait_for_pending_saves(timeout_s) for c in _worker_kvwire_connectors()])

    def kvwire_stats(self) -> dict[str, int | float]:
        merged: dict[str, int | float] = {}
        for connector in _worker_kvwire_connectors():
            for name, value in connector.stats_totals().items():
                merged[name] = merged.get(name, 0) + value
        return merged


def wait_for_saves(llm: Any, timeout_s: float = 60.0) -> None:
    """Block until every save started by `llm`'s KVWireConnector is complete and confirmed.

    Raises `TimeoutError` if that takes longer than `timeout_s`.
    """
    _check_timeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    if not all(_call_workers(llm, "kvwire_wait_for_saves", timeout_s)):
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


def _check_timeout(timeout_s: object) -> None:
    # NaN or inf would make the deadline one that never passes: the wait
    # could then step the engine forever.
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise ValueError(
            f"wait_for_saves: timeout_s must be a finite number of seconds > 0, "
            f"got {shown(timeout_s)}"
        )


def kvwire_stats(llm: Any) -> dict[str, int | float]:
    """kvwire's counters since `llm` started, flattened (`<child>.<counter>` for composites)."""
    merged: dict[str, int | float] = {}
    for worker_totals in _call_workers(llm, "kvwire_stats"):
        for name, value in worker_totals.items():
            merged[name] = merged.get(name, 0) + value
    return merged


def _call_workers(llm: Any, method: str, *args: Any) -> list[Any]:
    try:
        results: list[Any] = llm.collective_rpc(method, args=args)
    except AttributeError as error:
        raise RuntimeError(
            f"kvwire: the LLM's workers have no {method}(); start the LLM with "
            f"worker_extension_cls={WORKER_EXTENSION!r}"
        ) from error
    return results


def _worker_kvwire_connectors() -> list[KVWireConnector]:
    """This worker's KVWireConnectors: its connector, or the children of vLLM's MultiConnector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return list(_kvwire_connectors_in(get_kv_transfer_group())) if has_kv_transfer_group() else []


def _kvwire_connectors_in(connector: Any) -> Iterator[KVWireConnector]:
    if isinstance(connector, KVWireConnector):
        yield connector
        return
    for child in getattr(connector, "sub_connectors", ()):  # vLLM's MultiConnector
        yield from _kvwire_connectors_in(child)
