"""kvwire's I/O threads in a vLLM CPU worker run on the engine's cores, not the model's pin."""

from __future__ import annotations

import os
import threading

from kvwire.vllm.cores import threads_started_on_engine_cores


def affinity_of_a_thread_started() -> set[int]:
    seen: list[set[int]] = []
    thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join(timeout=10)
    return seen[0]


def test_threads_started_inside_run_on_the_parent_s_cores_and_the_pin_is_put_back() -> None:
    engine = os.sched_getaffinity(os.getppid())
    mine = os.sched_getaffinity(0)
    # As vLLM's CPU executor pins a worker's main thread to the model's core.
    model_core = {min(mine & engine)}
    os.sched_setaffinity(0, model_core)
    try:
        assert affinity_of_a_thread_started() == model_core  # what a thread inherits
        with threads_started_on_engine_cores():
            started_inside = affinity_of_a_thread_started()
        assert os.sched_getaffinity(0) == model_core
        assert affinity_of_a_thread_started() == model_core
    finally:
        os.sched_setaffinity(0, mine)
    assert started_inside == engine


def test_a_thread_not_pinned_narrower_than_its_parent_is_left_alone() -> None:
    mine = os.sched_getaffinity(0)
    with threads_started_on_engine_cores():
        assert os.sched_getaffinity(0) == mine
        assert affinity_of_a_thread_started() == mine
    assert os.sched_getaffinity(0) == mine
