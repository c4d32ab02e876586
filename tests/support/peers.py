"""The peer medium's tests: engines on the tiny model with the peer medium, and their processes.

Start a peer engine process, have it generate, stop, kill or stall it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import attrs

from kvwire.config import EngineConfig, KVRole, ParallelConfig
from kvwire.engine.engine import GenerationRequest
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.engines import tiny_config, with_connector
from tests.support.redis import UNHURRIED_REDIS

# Engines for the peer medium's tests: the tiny model, the peer medium's config, a workload.

BLOCK_SIZE = 4

UNHURRIED_DEADLINES = {**UNHURRIED_REDIS, "transfer_timeout_s": 30.0}
"""A peer engine's deadlines in a test whose subject is not a deadline. On a host loaded
by the rest of ``make test`` (the vLLM suite beside this one, a split producer's and a
split reader's worker processes), a fresh worker's first directory call has taken over
the default 1 s and its pull over 5 s: the read then fails and is computed again, right
for the engine and wrong for a test that means to see each rank pull its share."""


def peer_config(
    url: str,
    key_prefix: str,
    *,
    kv_role: KVRole = "kv_both",
    peer_name: str | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    **extra: Any,
) -> EngineConfig:
    """The tiny engine with the peer medium, its directory at ``url`` under ``key_prefix``.

    Split over ``tensor_parallel_size`` x ``pipeline_parallel_size`` worker
    processes when either is above 1 (the tiny model has two KV heads and
    two layers: one of each a rank at size 2).

    Its deadlines are unhurried (``UNHURRIED_DEADLINES``): a test whose
    subject is a deadline passes its own.
    """
    options: dict[str, Any] = {
        "medium": "peer",
        "url": url,
        "key_prefix": key_prefix,
        "cpu_pool_bytes": "4MiB",
        "staging_blocks": 8,
        "peer_heartbeat_s": 1,
        **UNHURRIED_DEADLINES,
        **extra,
    }
    if peer_name is not None:
        options["peer_name"] = peer_name
    config = with_connector(
        tiny_config(block_size=BLOCK_SIZE), "OffloadConnector", options, kv_role=kv_role
    )
    if tensor_parallel_size == pipeline_parallel_size == 1:
        return config
    parallel = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size
    )
    return attrs.evolve(config, parallel_config=parallel)


def prompts(seed: int, num_requests: int = 4, prompt_len: int = 30) -> list[GenerationRequest]:
    """Requests sharing most of a prefix of their ``seed``'s, block-unaligned; ids name the seed."""
    spec = WorkloadSpec(
        num_requests=num_requests,
        prompt_len=prompt_len,
        output_len=5,
        shared_prefix_ratio=0.7,
        vocab_size=300,
        seed=seed,
    )
    return [
        attrs.evolve(request, request_id=f"seed{seed}-{request.request_id}")
        for request in synthetic_workload(spec)
    ]


# Peer engine processes for the tests: start one, have it generate, stop, kill or stall it.

_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Importing torch and starting NIXL on two loaded cores took over 120 s once, in a
# make test run beside other work: the bound only keeps a stuck peer from hanging.
# Below pytest's own timeout (300 s), so that a peer past it is reported with
# where each of its processes waited, not cut off by pytest without a word.
_START_TIMEOUT_S = 240.0
_REPLY_TIMEOUT_S = 240.0
# How much of a peer's log a timeout shows: the tracebacks its processes printed.
_LOG_TAIL_CHARS = 12_000


class PeerProcess:
    """An engine with the peer medium in a child process (``peer_process.py``)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        # The tests' own path after the root's: the process imports the same kvwire as the tests.
        path = [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        # Fault handlers on: a SIGABRT makes every process of the peer (its engine's
        # worker processes too) print where each of its threads is, into its log.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONFAULTHANDLER": "1"}
        # Closed by stop(): it lives as long as the process, beyond any one block.
        self._log = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        # A session of its own: its worker processes are its process group, ended with it.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.processes.peer", json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=_ROOT,
            env=env,
            text=True,
            start_new_session=True,
        )
        assert self._read(_START_TIMEOUT_S) == {"ready": True}

    def generate(self, requests: list[GenerationRequest]) -> dict[str, Any]:
        """Run ``requests`` there; its outputs (as dicts) and connector stats, saves announced."""
        command = {
            "generate": [[r.request_id, list(r.prompt_token_ids), r.max_tokens] for r in requests]
        }
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        return self._read(_REPLY_TIMEOUT_S)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self._process.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"the peer process said nothing within {timeout_s} s; its log (each "
                    f"process's threads where they waited) ends:\n{self._abort()}"
                )
            ready, _, _ = select.select([self._process.stdout], [], [], left)
            if ready:
                line = self._process.stdout.readline()
                if not line:
                    raise RuntimeError(f"the peer process ended (exit {self._process.wait(10)})")
                if line.startswith("{"):
                    reply: dict[str, Any] = json.loads(line)
                    return reply

    def worker_pids(self) -> list[int]:
        """The process ids of its engine's worker processes (one per rank of a split engine)."""
        pid = self._process.pid
        children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [
            int(child)
            for child in children
            if b"spawn_main" in pathlib.Path(f"/proc/{child}/cmdline").read_bytes()
        ]

    def stall(self) -> None:
        """SIGSTOP: alive, holding its connections, answering nothing."""
        os.kill(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self._process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, to it and its worker processes: no shutdown, its directory entries and
        record left behind."""
        self._signal_group(signal.SIGKILL)
        self._process.wait(30)

    def log(self) -> str:
        """What its processes wrote to stderr, the last `_LOG_TAIL_CHARS` of it."""
        self._log.seek(0)
        return self._log.read()[-_LOG_TAIL_CHARS:]

    def _abort(self) -> str:
        """Have every process of the peer print its threads' tracebacks and end; its log."""
        self.resume()
        self._signal_group(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(30)
        self.kill()
        return self.log()

    def _signal_group(self, signum: int) -> None:
        # ProcessLookupError: the whole group has ended already.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signum)

    def stop(self) -> None:
        try:
            if self._process.poll() is None:
                self._quit()
        finally:
            self._log.close()

    def _quit(self) -> None:
        self.resume()
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps({"quit": True}) + "\n")
            self._process.stdin.close()
            self._process.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
