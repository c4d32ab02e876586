"""Which cores kvwire's I/O threads run on in a vLLM CPU worker: the engine's, not the model's.

vLLM's CPU executor gives each worker's model its own cores
(`VLLM_CPU_OMP_THREADS_BIND`) and keeps the rest of the engine's
(`VLLM_CPU_NUM_OF_RESERVED_CPU`) for its engine-core process: it sets
OpenMP's places for the worker, and libgomp pins the worker's main thread to
them as torch loads. A thread starts with the affinity of the thread that
starts it, so kvwire's save and load threads, started from that main thread,
would run on the model's cores alone: each checksum, copy and syscall taken
from the forward pass while the reserved core has time, and a store's runs
per transfer cut to the model's one core. So the worker side starts its
threads (builds its connector, registers the KV caches) with the main
thread's affinity widened, for that while, to its parent's, the engine-core
process vLLM does not pin; the main thread's pin is put back at once.

Nothing changes where the calling thread is not pinned narrower than its
parent (an in-process engine, `taskset` over the whole engine, a platform
without `sched_setaffinity`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def threads_started_on_engine_cores() -> Iterator[None]:
    """Threads started in this block may run on the parent process's cores."""
    get_affinity = getattr(os, "sched_getaffinity", None)
    set_affinity = getattr(os, "sched_setaffinity", None)
    if get_affinity is None or set_affinity is None:
        yield
        return
    pinned: set[int] = get_affinity(0)
    try:
        engine: set[int] = get_affinity(os.getppid())
    except OSError:  # the parent is gone or not ours to ask
        engine = pinned
    if not pinned < engine:
        yield
        return
    set_affinity(0, engine)
    try:
        yield
    finally:
        set_affinity(0, pinned)
