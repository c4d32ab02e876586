"""The engine: a scheduler and a worker, stepped until every request is done.

Both get their connector (one per role) from a
`ConnectorSource`; with
`worker_mode="process"` the worker and its connector live in another
process and each step's instructions cross by pickling. The parts are
assembled in `kvwire.engine.container`; the engine only steps them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import build_kv_cache_config
from kvwire.engine.container import (
    EngineContainer,
    EngineOptions,
    EngineParts,
    WorkerMode,
    build_engine_parts,
    decide_engine_hma,
    engine_container,
)
from kvwire.engine.worker import Worker
from kvwire.interface.base import KVConnectorBase
from kvwire.interface.types import KVConnectorStats, Request, RequestStatus

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "EngineCounters",
    "GenerationRequest",
    "LLMEngine",
    "RequestOutput",
    "WorkerMode",
    "build_engine",
    "build_kv_cache_config",
    "decide_engine_hma",
]

logger = logging.getLogger(__name__)


@attrs.frozen
class GenerationRequest:
    """One prompt to complete: `max_tokens` greedy tokens after `prompt_token_ids`.

    `kv_transfer_params` are the request's parameters for the connector, as
    vLLM's request carries them (e.g. `{"max_load_tokens": 64}`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


@attrs.frozen
class RequestOutput:
    """A finished request: its tokens, where its prefix came from, and its timings.

    `error` is set (and `status` is FINISHED_ERROR) when the request
    failed, e.g. a load error under `kv_load_failure_policy="fail"`.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    status: RequestStatus
    error: str | None
    local_cached_tokens: int
    external_tokens: int
    time_to_first_token_s: float | None
    latency_s: float
    num_preemptions: int
    num_load_failures: int
    kv_transfer_params: dict[str, Any] | None


@attrs.define
class EngineCounters:
    """Where the engine's time went, and how often it preempted (for benchmarks)."""

    steps: int = 0
    schedule_s: float = 0.0
    worker_s: float = 0.0
    update_s: float = 0.0
    preemptions: int = 0


class LLMEngine:
    """A paged-KV inference engine on CPU that drives a connector like a server would.

    Its keyword options (`EngineOptions`, their defaults the `EngineContainer`'s):
    `connector_hook` sees each connector once it is built (the conformance
    kit instruments them this way); `capture_kv` keeps each finished
    request's prompt KV in `captured_kv`. `container` is a
    `kvwire.KVConnectorContainer` whose providers the caller
    has overridden (the worker process, if any, builds its own from
    `config`): e.g. a registry whose medium makes loads fail on purpose
    (`kvwire.testing.faulty_medium`). `worker_container_hook` (picklable) runs on
    each worker process's own container, its rank injected, before its
    connector is built: the way to override providers there (the inline
    worker uses `container`). `torch_threads` sets the worker process's torch threads
    (None leaves them alone); a worker process that does not answer a call
    within `worker_reply_timeout_s` is stopped, and the call raises.
    Requests admitted in one step share their common prefix's blocks, as
    vLLM's scheduler does, except blocks being loaded: a request waits for a
    prefix another request is loading (asynchronously, or synchronously in
    this step) rather than loading a copy or computing on a failed load. Use as a context
    manager, or call `close`.

    `connector_stats` sums the worker connector's stats over the steps;
    saves still running when `generate` returns join it at
    `wait_for_saves` or `close`.

    A hybrid model (`model_config.layer_types` with sliding-window
    layers) runs with one KV cache group per kind of layer when the HMA
    gate keeps HMA on, else with one group of every layer; `hma`
    says which, and why. Outputs are the same either way.

    Tensor and pipeline parallelism: a config whose `parallel_config` sets
    `tensor_parallel_size` and `pipeline_parallel_size` runs one worker
    process per rank (`worker_mode` must then be `"process"` or None,
    which picks it), each holding its share of the KV heads and layers
    (`kvwire.engine.parallel`), with the worker connector built there
    for its rank; `shares` lists them. The scheduler connector is
    rank 0's share's, as in vLLM; the ranks' reports merge as vLLM merges
    them (`kvwire.ranks`). The tokens are the same at every parallel
    size.

    The parts are assembled by an `EngineContainer` (`kvwire.engine.container`):
    `LLMEngine(config, ...)` builds one with these options and no overrides; to
    swap a part, override its provider there and call `build_engine`.
    """

    def __init__(self, config: EngineConfig, **options: Unpack[EngineOptions]) -> None:
        self._adopt(build_engine_parts(engine_container(config, **options)))

    @classmethod
    def from_parts(cls, parts: EngineParts) -> LLMEngine:
        """An engine of parts built already (by an `EngineContainer`: see `build_engine`)."""
        engine = cls.__new__(cls)
        engine._adopt(parts)
        return engine

    def _adopt(self, parts: EngineParts) -> None:
        self.config = parts.config
        self.hma = parts.hma
        self.kv_cache_config = parts.kv_cache_config
        self.shares = parts.shares
        self.scheduler = parts.scheduler
        self.scheduler_connector = parts.scheduler.connector
        self.worker = parts.worker
        # What runs in other processes, stopped at `close`; None for the inline worker.
        self._worker_process: Any = None if isinstance(parts.worker, Worker) else parts.worker
        self._source = parts.connector_source
        self.capture_kv = parts.capture_kv
        self.captured_kv: dict[str, torch.Tensor] = {}
        self.idle_timeout_s = parts.idle_timeout_s
        self.counters = EngineCounters()
        self.connector_stats = KVConnectorStats()
        self._closed = False

    @property
    def hma_enabled(self) -> bool:
        """Whether the hybrid KV cache manager is on (see `hma` for why)."""
        return self.hma.enabled

    @property
    def worker_connector(self) -> KVConnectorBase | None:
        """The worker-role connector, when the worker runs in this process."""
        return self.worker.connector if isinstance(self.worker, Worker) else None

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def add_request(self, request: GenerationRequest) -> None:
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                max_tokens=request.max_tokens,
                kv_transfer_params=request.kv_transfer_params,
            )
        )

    def step(self) -> tuple[int, list[Request]]:
        """One schedule-execute-update round; tokens scheduled and requests finished."""
        started = time.perf_counter()
        output, step = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        result = self.worker.execute(step)
        executed_at = time.perf_counter()
        finished = self.scheduler.update_from_output(output, result)
        if result.connector_output is not None:
            self._add_connector_stats(result.connector_output.kv_connector_stats)
        if self.capture_kv:
            for request in finished:
                block_ids = self.scheduler.block_ids_at_finish.get(request.request_id, ())
                num_tokens = min(request.num_prompt_tokens, request.num_computed_tokens)
                self.captured_kv[request.request_id] = self.worker.gather_kv(block_ids, num_tokens)
        self.scheduler.block_ids_at_finish.clear()
        counters = self.counters
        counters.steps += 1
        counters.schedule_s += scheduled_at - started
        counters.worker_s += executed_at - scheduled_at
        counters.update_s += time.perf_counter() - executed_at
        counters.preemptions = self.scheduler.num_preemptions
        return output.total_num_scheduled_tokens, finished

    def run_until_done(self, on_finished: Callable[[Request], None] | None = None) -> None:
        """Step until no request and no connector transfer is outstanding."""
        idle_since: float | None = None
        while self.scheduler.has_unfinished_work():
            num_scheduled, finished = self.step()
            if on_finished is not None:
                for request in finished:
                    on_finished(request)
            if num_scheduled:
                idle_since = None
                continue
            # Nothing to compute: only the connector's transfers are pending.
            now = time.perf_counter()
            if idle_since is None:
                idle_since = now
            elif now - idle_since > self.idle_timeout_s:
                raise RuntimeError(
                    f"no progress for {self.idle_timeout_s:.0f} s: "
                    f"{self.scheduler.describe_stuck_requests()}; the connector "
                    f"({type(self.scheduler_connector).__name__}) never reported them done"
                )
            time.sleep(0.0005)

    def generate(
        self,
        requests: Iterable[GenerationRequest],
        on_finished: Callable[[Request], None] | None = None,
    ) -> list[RequestOutput]:
        """Run `requests` to completion; their outputs, in the order given."""
        request_ids = []
        for request in requests:
            self.add_request(request)
            request_ids.append(request.request_id)
        self.run_until_done(on_finished)
        return [self.output_of(request_id) for request_id in request_ids]

    def output_of(self, request_id: str) -> RequestOutput:
        request = self.scheduler.requests[request_id]
        metrics = self.scheduler.metrics[request_id]
        first_token = metrics.first_token_time
        finish = metrics.finish_time if metrics.finish_time is not None else time.perf_counter()
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            output_token_ids=tuple(request.output_token_ids),
            status=request.status,
            error=request.error,
            local_cached_tokens=metrics.local_cached_tokens or 0,
            external_tokens=metrics.external_tokens or 0,
            time_to_first_token_s=(
                None if first_token is None else first_token - metrics.arrival_time
            ),
            latency_s=finish - metrics.arrival_time,
            num_preemptions=metrics.num_preemptions,
            num_load_failures=metrics.num_load_failures,
            kv_transfer_params=request.kv_transfer_params,
        )

    def wait_for_saves(self) -> None:
        """Wait for the connector's saves still running, and add them to `connector_stats`.

        A save may outlive the request that made it (store-backed connectors
        write in the background, after the blocks were freed), so the stats
        at the end of `generate` may miss some; after this call they
        count every save of the requests run so far, and the KV cache events
        those saves caused are in the scheduler's `kv_events`. Raises
        `RuntimeError` when saves are still running after `idle_timeout_s`.
        """
        finished, output = self.worker.wait_for_saves(self.idle_timeout_s)
        if output is not None:
            self._add_connector_stats(output.kv_connector_stats)
            self.scheduler.add_late_connector_events(output.kv_cache_events)
        if not finished:
            raise RuntimeError(
                f"saves still running after {self.idle_timeout_s:g} s (idle_timeout_s): the "
                f"connector ({type(self.scheduler_connector).__name__}) did not finish them"
            )

    def reset_prefix_cache(self) -> bool:
        """Forget the local prefix cache (so the next prompts must come from the connector)."""
        return self.scheduler.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Stop the worker and shut down both connectors, once.

        Saves still running are waited for first (as `wait_for_saves`
        does, up to `idle_timeout_s`), so their stats go to
        `connector_stats` and their KV cache events to the scheduler's
        `kv_events` like any step's. The worker connector's shutdown then
        lets whatever is still in flight finish; its counts, reported after
        it, still go to `connector_stats`.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_for_saves()
        except Exception as error:
            # A save that never ends or a worker that died must not stop the shutdown.
            logger.warning("closing with saves not waited for: %s", error)
        try:
            if self._worker_process is not None:
                self._add_connector_stats(self._worker_process.shutdown())
        finally:
            self._add_connector_stats(self._source.shutdown())

    def _add_connector_stats(self, stats: KVConnectorStats | None) -> None:
        if stats is not None:
            self.connector_stats.aggregate(stats)


def build_engine(container: EngineContainer) -> LLMEngine:
    """The engine of `container`'s parts, after any of its providers was overridden.

    A part that fails to build shuts down the parts built before it (a
    connector built for the scheduler side must not outlive a worker that
    failed to start).
    """
    return LLMEngine.from_parts(build_engine_parts(container))
