"""Run the worker in its own process, with each step's instructions pickled across.

The worker process assembles its worker with a
`WorkerContainer`, its own
connector (WORKER role) from its own connectors; the only thing it shares
with the scheduler is the bytes
of each `WorkerStep` and
`StepResult`. That proves the connector metadata
is picklable and that the two roles keep no common state.

One rank of a parallel engine (`RankSetup`) builds its connector in a
container whose `parallel_config` provider is its rank's, the way any
application injects a worker's rank, and joins the other ranks' process
group (`kvwire.engine.rank_group`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import attrs
import torch

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.engine.connector_source import ConnectorHook, ConnectorSource, ContainerHook
from kvwire.engine.parallel import RankShare
from kvwire.engine.step import StepResult, WorkerStep
from kvwire.engine.worker import Worker
from kvwire.engine.worker_container import WorkerContainer
from kvwire.exceptions import WorkerProcessError as WorkerProcessError
from kvwire.interface.types import KVConnectorOutput, KVConnectorStats

START_TIMEOUT_S = 300.0
"""The least time a worker process gets to start: spawn, import torch, build the connector."""


@attrs.frozen
class RankSetup:
    """What one rank's process needs besides the engine config: its share, and its group.

    `store_path`: the file (in a directory the engine made) through which
    the ranks meet; `timeout_s`: the most any exchange between them waits.
    """

    share: RankShare
    store_path: str
    timeout_s: float


@attrs.frozen
class _WorkerSetup:
    """What the worker process builds its worker from, pickled to it as one argument."""

    config: EngineConfig
    kv_cache_config: KVCacheConfig
    connector_hook: ConnectorHook | None
    torch_threads: int | None
    rank: RankSetup | None
    container_hook: ContainerHook | None


def _build_worker(setup: _WorkerSetup) -> tuple[Worker, ConnectorSource, Any]:
    config, rank = setup.config, setup.rank
    group = None
    if rank is not None:
        from kvwire.engine.rank_group import RankGroup

        group = RankGroup(
            rank.store_path,
            rank.share.parallel,
            max_num_tokens=config.scheduler_config.max_num_batched_tokens,
            local_width=len(rank.share.query_heads) * config.model_config.head_size,
            timeout_s=rank.timeout_s,
        )
    container = WorkerContainer(
        config=config,
        kv_cache_config=setup.kv_cache_config if rank is None else rank.share.kv_cache_config,
        share=None if rank is None else rank.share,
        exchange=group,
        torch_threads=setup.torch_threads,
        connector_hook=setup.connector_hook,
    )
    try:
        if setup.container_hook is not None:
            setup.container_hook(container.connectors())
        worker: Worker = container.worker()
        source: ConnectorSource = container.connector_source()
    except BaseException:
        if group is not None:
            group.close()
        raise
    return worker, source, group


def _serve(connection: Connection, setup: _WorkerSetup) -> None:
    # Ctrl-C reaches the whole process group: the parent handles it and stops
    # this process; here it would only end a step half-way, with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Blocked since this process started (`_start_holding_sigint`): one that
    # came meanwhile is dropped now, as ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    threading.Thread(target=_end_with_parent, name="kvwire-parent-watch", daemon=True).start()
    try:
        worker, source, group = _build_worker(setup)
    except BaseException:
        connection.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    connection.send_bytes(pickle.dumps(("ok", None)))
    try:
        _answer(connection, worker, source)
    finally:
        if group is not None:
            group.close()


def _end_with_parent() -> None:
    """End this process at once when its parent has ended, whatever it is doing.

    A parent killed (or crashed) sends no `shutdown`: a worker in a long start
    or step would otherwise go on, with nobody to answer, until that ends.
    """
    parent = multiprocessing.parent_process()
    if parent is not None:
        # No deadline: the parent's end is what this thread is for (it dies with the process).
        parent.join()
        os._exit(1)


def _answer(connection: Connection, worker: Worker, source: ConnectorSource) -> None:
    """Carry out the engine's commands until it sends `shutdown` (or its end of the pipe closes)."""
    while True:
        try:
            message = connection.recv_bytes()
        except EOFError:
            return  # the parent has ended: nothing more to do, and nobody to tell
        command, payload = pickle.loads(message)
        try:
            if command == "execute":
                reply: Any = worker.execute(payload)
            elif command == "gather_kv":
                reply = worker.gather_kv(*payload)
            elif command == "wait_for_saves":
                reply = worker.wait_for_saves(payload)
            else:
                reply = source.shutdown()
        except BaseException:
            connection.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        else:
            connection.send_bytes(pickle.dumps(("ok", reply)))
        if command == "shutdown":
            # Even a shutdown that failed is the last command: the parent
            # joins this process next, and must not wait for it.
            return


def _start_holding_sigint(process: multiprocessing.process.BaseProcess) -> None:
    """Start `process` with SIGINT blocked, until `_serve` ignores it.

    A terminal's Ctrl-C reaches the whole process group. A worker process still
    starting (spawn's bootstrap, its parent's main module and torch imported
    again: seconds on a busy host) would end with a `KeyboardInterrupt`
    traceback; the parent handles the Ctrl-C and stops it. The signal mask
    survives spawn's fork and exec, so the worker holds any SIGINT from its
    first instruction; this thread gets one that came meanwhile once its mask
    is restored, and other threads take theirs as usual.
    """
    # Starting multiprocessing's resource tracker unblocks SIGINT whatever the
    # mask was: it must not start inside `process.start()`.
    multiprocessing.resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class WorkerProcess:
    """A `Worker` in a spawned process, driven over a pipe.

    Same calls as the in-process worker: `execute`, `gather_kv`,
    `wait_for_saves`, and `shutdown` (which returns the
    connector's last stats, taken after its shutdown). Each message is
    pickled explicitly. A reply that does not come within `reply_timeout_s`
    (a wait for saves: its own timeout more) is an error, never a hang: the
    process, in an unknown state, is stopped. `rank` makes it one rank of
    a parallel engine; `container_hook` runs on the process's container
    (its rank injected) before its connector is built; `wait_started`
    False returns once it is spawned (the ranks of an engine start together:
    each waits for the others), and `wait_started` waits for it.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        *,
        connector_hook: ConnectorHook | None = None,
        torch_threads: int | None = 1,
        reply_timeout_s: float = 600.0,
        rank: RankSetup | None = None,
        container_hook: ContainerHook | None = None,
        wait_started: bool = True,
    ) -> None:
        self._reply_timeout_s = reply_timeout_s
        # spawn, not fork: the child must build everything itself, sharing
        # no memory (and no torch thread pools) with the scheduler.
        context = multiprocessing.get_context("spawn")
        self._connection, child_connection = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(
                child_connection,
                _WorkerSetup(
                    config, kv_cache_config, connector_hook, torch_threads, rank, container_hook
                ),
            ),
            name="kvwire-worker" if rank is None else f"kvwire-worker-{rank.share.parallel.rank}",
            daemon=True,
        )
        _start_holding_sigint(self._process)
        child_connection.close()
        self._closed = False
        if wait_started:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait until the process has built its worker (or raise its error, stopping it)."""
        try:
            self._receive("start", max(self._reply_timeout_s, START_TIMEOUT_S))
        except Exception:
            self._stop()
            raise
        except BaseException:
            # Interrupted (Ctrl-C) while it starts: it leaves SIGINT to this
            # process and would finish starting first, so it is stopped now.
            _stop_interrupted([self])
            raise

    def execute(self, step: WorkerStep) -> StepResult:
        result: StepResult = self._call("execute", step)
        return result

    def gather_kv(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> torch.Tensor:
        kv: torch.Tensor = self._call("gather_kv", (block_ids, num_tokens))
        return kv

    def wait_for_saves(self, timeout_s: float) -> tuple[bool, KVConnectorOutput | None]:
        reply: tuple[bool, KVConnectorOutput | None] = self._call(
            "wait_for_saves", timeout_s, timeout_s + self._reply_timeout_s
        )
        return reply

    def shutdown(self) -> KVConnectorStats | None:
        if self._closed:
            return None
        try:
            if not self._process.is_alive():
                return None
            stats: KVConnectorStats | None = self._call("shutdown", None)
            return stats
        finally:
            self._stop()

    def _stop(self) -> None:
        """Let the process exit (killed if it does not), and close the pipe."""
        self._closed = True
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=30)
        self._connection.close()

    def _call(self, command: str, payload: Any, reply_timeout_s: float | None = None) -> Any:
        try:
            self._send(command, payload)
            return self._receive(
                command, self._reply_timeout_s if reply_timeout_s is None else reply_timeout_s
            )
        except Exception:
            raise  # in step: it answered (perhaps its own error), or was stopped already
        except BaseException:
            _stop_interrupted([self])
            raise

    def _send(self, command: str, payload: Any, pickled: bytes | None = None) -> None:
        if self._closed:
            raise WorkerProcessError(f"the worker process was stopped; cannot {command}")
        self._connection.send_bytes(
            pickle.dumps((command, payload)) if pickled is None else pickled
        )

    def _receive(self, command: str, timeout_s: float) -> Any:
        if not self._connection.poll(timeout_s):
            # A late reply would answer the next command: this process is done.
            self._process.kill()
            self._stop()
            raise WorkerProcessError(
                f"the worker process sent no reply to {command!r} within {timeout_s:g} s "
                "(reply_timeout_s); it was stopped"
            )
        return self._read_reply()

    def _read_reply(self) -> Any:
        """The reply waiting on the pipe (`WorkerProcessError` for an error or an exit)."""
        try:
            status, reply = pickle.loads(self._connection.recv_bytes())
        except EOFError:
            raise WorkerProcessError(
                f"the worker process exited (exit code {self._process.exitcode})"
            ) from None
        if status == "error":
            raise WorkerProcessError(f"the worker process failed:\n{reply}")
        return reply


def call_each(
    processes: Sequence[WorkerProcess],
    command: str,
    payload: Any,
    reply_timeout_s: float | None = None,
) -> list[Any]:
    """`command` sent to every process, then each one's reply, in order.

    Sent to all before any reply is awaited: the ranks of a parallel engine
    work on a step together, each waiting for the others.
    """
    pickled = pickle.dumps((command, payload))  # once, whatever the number of ranks
    try:
        for process in processes:
            process._send(command, payload, pickled)
    except Exception:
        raise
    except BaseException:
        _stop_interrupted(processes)
        raise
    return gather_replies(processes, command, reply_timeout_s)


def _stop_interrupted(processes: Sequence[WorkerProcess]) -> None:
    """Stop processes whose call was interrupted (Ctrl-C) half-way, at once.

    A command half sent, or a reply still to come, would answer the next
    command: their pipes are out of step.
    """
    for process in processes:
        if not process._closed:
            process._process.kill()
            process._stop()


def gather_replies(
    processes: Sequence[WorkerProcess], command: str, reply_timeout_s: float | None = None
) -> list[Any]:
    """Each process's reply to `command`, taken as they come, in the processes' order.

    A rank that fails (or exits) leaves the others waiting for it in an
    exchange, for as long as its timeout: so the first failure stops every
    process at once and raises, as does a process silent past the deadline.
    """
    timeout_s = processes[0]._reply_timeout_s if reply_timeout_s is None else reply_timeout_s
    deadline = time.monotonic() + timeout_s
    replies: list[Any] = [None] * len(processes)
    waiting = {process._connection: index for index, process in enumerate(processes)}
    try:
        while waiting:
            ready = multiprocessing.connection.wait(
                list(waiting), timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise WorkerProcessError(
                    f"worker processes {sorted(waiting.values())} sent no reply to {command!r} "
                    f"within {timeout_s:g} s (reply_timeout_s); every one was stopped"
                )
            for connection in ready:
                index = waiting.pop(connection)  # type: ignore[call-overload]
                replies[index] = processes[index]._read_reply()
    except BaseException:
        for process in processes:
            if not process._closed:
                # In an unknown state (perhaps waiting for the failed one): stopped now.
                process._process.kill()
                process._stop()
        raise
    return replies
