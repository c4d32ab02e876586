"""The CPU time of kvwire's threads in a server's processes, read from /proc."""

from __future__ import annotations

import os
import pathlib
import threading
import time

from benchmarks.thread_cpu import (
    cpu_seconds_of_threads,
    kvwire_cpu_seconds,
    process_tree,
    server_pid,
)

from kvwire.media.io_threads import IOThreads

TICKS = os.sysconf("SC_CLK_TCK")


def fake_process(
    proc: pathlib.Path,
    pid: int,
    parent: int,
    command: list[str],
    threads: dict[int, tuple[str, int]],
) -> None:
    """A /proc entry: its command line, its parent, and threads of (name, CPU ticks)."""
    root = proc / str(pid)
    (root / "task").mkdir(parents=True)
    (root / "cmdline").write_bytes(b"\0".join(arg.encode() for arg in command) + b"\0")
    (root / "stat").write_text(f"{pid} (python) S {parent} 1 1 0 -1 0 0 0 0 0 7 3 0 0 20\n")
    for tid, (name, ticks) in threads.items():
        (root / "task" / str(tid)).mkdir()
        # utime and stime are the 14th and 15th fields; a name may hold spaces and ")".
        fields = f"S {pid} 1 1 0 -1 0 0 0 0 0 {ticks} {ticks} 0 0 20"
        (root / "task" / str(tid) / "stat").write_text(f"{tid} ({name}) {fields}\n")


def server(proc: pathlib.Path) -> None:
    api = [".venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8001"]
    fake_process(proc, 100, 1, api, {100: ("python", 500), 101: ("kvwire-save-0", 9)})
    fake_process(proc, 200, 100, ["VLLM::EngineCore"], {200: ("VLLM::EngineCor", 900)})
    fake_process(
        proc,
        300,
        200,
        ["VLLM::Worker"],
        {300: ("VLLM::Worker", 900), 301: ("kvwire-cpu-save", 40), 302: ("kvwire-cpu-load", 10)},
    )
    other = [".venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "80010"]
    fake_process(proc, 400, 1, other, {400: ("kvwire-cpu-save", 1000)})


def test_a_server_is_found_by_its_port_and_its_tree_holds_its_engine_and_worker(
    tmp_path: pathlib.Path,
) -> None:
    server(tmp_path)
    assert server_pid(8001, tmp_path) == 100
    assert server_pid(80010, tmp_path) == 400
    assert server_pid(8002, tmp_path) is None
    assert sorted(process_tree(100, tmp_path)) == [100, 200, 300]


def test_only_kvwire_s_threads_of_the_server_s_processes_count(tmp_path: pathlib.Path) -> None:
    server(tmp_path)
    # Both user and system ticks: 2 * (9 + 40 + 10); not the other server's thread.
    assert kvwire_cpu_seconds(8001, tmp_path) == 2 * 59 / TICKS
    assert kvwire_cpu_seconds(8002, tmp_path) is None
    assert cpu_seconds_of_threads([200], proc=tmp_path) == 0


def test_kvwire_s_io_threads_are_counted_from_the_real_proc() -> None:
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            sum(range(1000))

    threads = IOThreads(1, "kvwire-test-cpu")
    running = threads.submit(spin)
    try:
        # A busy thread is given CPU time within seconds, counted in clock ticks.
        seconds = 0.0
        for _ in range(200):
            seconds = cpu_seconds_of_threads([os.getpid()], prefix="kvwire-test")
            if seconds > 0:
                break
            time.sleep(0.05)
    finally:
        done.set()
        running.result(timeout=10)
        threads.shutdown()
    assert seconds > 0
