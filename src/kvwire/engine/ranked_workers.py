"""A parallel engine's worker processes, one per rank, driven as one worker.

Every rank gets every step (block ids are the same on every rank) and runs it
together with the others: its heads of its stage's layers, its connector moving
only those. The replies merge as vLLM merges its workers' (`RankOutputs`):
tokens from the last stage, a request finished transferring once every rank
says so, failed blocks united.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence

import torch

from kvwire.config import EngineConfig
from kvwire.engine.connector_source import ConnectorHook, ContainerHook
from kvwire.engine.parallel import RankShare
from kvwire.engine.step import StepResult, WorkerStep
from kvwire.engine.worker_process import (
    START_TIMEOUT_S,
    RankSetup,
    WorkerProcess,
    call_each,
    gather_replies,
)
from kvwire.interface.types import KVConnectorOutput, KVConnectorStats
from kvwire.ranks import RankOutputs


class RankedWorkers:
    """One `WorkerProcess` per share in `shares`.

    `finished_count`: how many ranks report a finished transfer before it
    counts (the scheduler connector's `get_finished_count()`; None: all).
    An exchange between ranks, like a reply, waits at most
    `reply_timeout_s`.
    """

    def __init__(
        self,
        config: EngineConfig,
        shares: Sequence[RankShare],
        *,
        connector_hook: ConnectorHook | None = None,
        container_hook: ContainerHook | None = None,
        torch_threads: int | None = 1,
        reply_timeout_s: float = 600.0,
        finished_count: int | None = None,
    ) -> None:
        self.shares = tuple(shares)
        self._reply_timeout_s = reply_timeout_s
        parallel = self.shares[0].parallel
        self._tensor_size = parallel.tensor_parallel_size
        # Tensor rank 0 of the last stage samples (every rank of it computes the same logits).
        self._sampler = (parallel.pipeline_parallel_size - 1) * self._tensor_size
        self._outputs = RankOutputs(parallel.world_size, finished_count)
        # Owner-only, and removed at shutdown: where the ranks meet.
        self._directory = tempfile.mkdtemp(prefix="kvwire-ranks-")
        store_path = os.path.join(self._directory, "group")
        self._processes: list[WorkerProcess] = []
        try:
            for share in self.shares:
                self._processes.append(
                    WorkerProcess(
                        config,
                        share.kv_cache_config,
                        connector_hook=connector_hook,
                        torch_threads=torch_threads,
                        reply_timeout_s=reply_timeout_s,
                        rank=RankSetup(share, store_path, reply_timeout_s),
                        container_hook=container_hook,
                        wait_started=False,
                    )
                )
            # In any order: a rank that fails to start stops the others at once
            # (they would wait for it to join their group).
            gather_replies(self._processes, "start", max(reply_timeout_s, START_TIMEOUT_S))
        except BaseException:
            self.shutdown()
            raise

    def execute(self, step: WorkerStep) -> StepResult:
        results: list[StepResult] = call_each(self._processes, "execute", step)
        return StepResult(
            sampled_token_ids=results[self._sampler].sampled_token_ids,
            connector_output=self._outputs.merge([result.connector_output for result in results]),
        )

    def gather_kv(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> torch.Tensor:
        """The request's KV as one unsplit worker holds it: heads, then stages, put together."""
        parts: list[torch.Tensor] = call_each(self._processes, "gather_kv", (block_ids, num_tokens))
        size = self._tensor_size
        stages = [
            torch.cat(parts[start : start + size], dim=3) for start in range(0, len(parts), size)
        ]
        return torch.cat(stages, dim=0)

    def wait_for_saves(self, timeout_s: float) -> tuple[bool, KVConnectorOutput | None]:
        replies: list[tuple[bool, KVConnectorOutput | None]] = call_each(
            self._processes, "wait_for_saves", timeout_s, timeout_s + self._reply_timeout_s
        )
        finished = all(done for done, _output in replies)
        return finished, self._outputs.merge([output for _done, output in replies])

    def shutdown(self) -> KVConnectorStats | None:
        """Stop every rank (each shuts its connector down first); their last stats, summed."""
        total: KVConnectorStats | None = None
        failure: BaseException | None = None
        for process in self._processes:
            # Every rank is stopped, even after one failed to shut down.
            try:
                stats = process.shutdown()
            except BaseException as error:
                failure = failure or error
                continue
            if stats is not None:
                total = stats if total is None else total.aggregate(stats)
        shutil.rmtree(self._directory, ignore_errors=True)
        if failure is not None:
            raise failure
        return total
