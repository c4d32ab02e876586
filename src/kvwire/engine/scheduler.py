"""The scheduler: queues, a token budget per step, and the scheduler-side connector calls.

Per step: running requests first (decode and prefill chunks), preempting
the newest running request when the pool runs dry; then waiting requests,
each asking the local prefix cache and then the connector
(`get_num_new_matched_tokens`) what is already known, allocating blocks,
telling the connector (`update_state_after_alloc`), and parking those whose
load is asynchronous. A scheduled chunk's full blocks enter the local
prefix cache at once (as in vLLM), so requests admitted later in the same
step share a common prefix instead of each loading or computing a copy,
and a request whose prefix a parked request is loading waits for that load.
Blocks loaded synchronously, and those computed after them, are published
only once the step shows the load sound: a request needing them waits a
step rather than compute on (and save) KV of a load that may have failed.
The step ends with `build_connector_meta`. After the worker's step: load
errors first (roll back or fail), then the sampled tokens, finished
receives and sends, and `update_connector_output`.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import attrs

from kvwire.config import EngineConfig
from kvwire.engine.block_hash import extend_block_hashes
from kvwire.engine.block_manager import NULL_BLOCK, BlockManager
from kvwire.engine.request_checks import check_request
from kvwire.engine.step import ScheduledChunk, StepResult, WorkerStep
from kvwire.interface.base import KVConnectorBase, KVConnectorMetadata, supports_hma
from kvwire.interface.types import (
    BlockHash,
    KVCacheEvent,
    KVConnectorOutput,
    Request,
    RequestStatus,
    ScheduledRequest,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@attrs.define
class RequestMetrics:
    """What happened to one request, for reports: cache hits and timings (seconds)."""

    arrival_time: float
    local_cached_tokens: int | None = None
    external_tokens: int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_load_failures: int = 0


class Scheduler:
    """Decides each step's work and keeps every request's state.

    `connector` is the SCHEDULER-role connector, or None to run without one.
    Each KV cache group gets its own blocks from `block_manager`'s one pool;
    block ids are given per group everywhere (one list per group).
    """

    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnectorBase | None,
        root_hash: BlockHash,
        block_manager: BlockManager,
    ) -> None:
        self.config = config
        self.block_size = config.cache_config.block_size
        self.connector = connector
        self.root_hash = root_hash
        self.block_manager = block_manager
        transfer = config.kv_transfer_config
        self.load_failure_policy = transfer.kv_load_failure_policy if transfer else "recompute"
        self.requests: dict[str, Request] = {}
        self.metrics: dict[str, RequestMetrics] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_since_last_step: set[str] = set()
        self._delayed_free: set[str] = set()
        # Parked requests: the number of computed tokens once their load lands.
        self._async_load_targets: dict[str, int] = {}
        # Parked requests: the hashes of the full blocks their load fills.
        self._loading_hashes: dict[str, tuple[BlockHash, ...]] = {}
        # This step: requests loading synchronously, and the hashes of their
        # full blocks from the load on (published after the step).
        self._loading_this_step: set[str] = set()
        self._unconfirmed_hashes: set[BlockHash] = set()
        self._failed_async_blocks: set[int] = set()
        # Blocks of requests' loaded ranges whose loads failed: the next step zeroes them.
        self._to_scrub: set[int] = set()
        self._loaded_and_ready: set[str] = set()
        self._ever_scheduled: set[str] = set()
        # The blocks (per group) each request held when it finished (for the engine's KV capture).
        self.block_ids_at_finish: dict[str, tuple[list[int], ...]] = {}
        self.kv_events: list[KVCacheEvent] = []

    # ------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request; its length must fit the model and the cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        check_request(request, self.config, self.block_manager.group_windows)
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, self.root_hash
        )
        self.requests[request.request_id] = request
        self.metrics[request.request_id] = RequestMetrics(arrival_time=time.perf_counter())
        self.waiting.append(request)

    def has_unfinished_work(self) -> bool:
        return bool(self.waiting or self.running or self._delayed_free)

    # ------------------------------------------------------------ schedule

    def schedule(self) -> tuple[SchedulerOutput, WorkerStep]:
        """Decide this step's work; the worker's instructions come with it."""
        budget = self.config.scheduler_config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        chunks: list[ScheduledChunk] = []
        preempted: set[str] = set()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_running(request, num_new, preempted):
                break
            self._schedule_chunk(request, num_new, scheduled, chunks)
            budget -= num_new
            index += 1

        if not preempted:
            budget = self._schedule_waiting(budget, scheduled, chunks)

        output = SchedulerOutput(
            scheduled=scheduled,
            finished_req_ids=set(self._finished_since_last_step),
            preempted_req_ids=preempted,
        )
        self._finished_since_last_step.clear()
        metadata: KVConnectorMetadata | None = None
        if self.connector is not None:
            metadata = self.connector.build_connector_meta(output)
        step = WorkerStep(
            chunks=tuple(chunks),
            finished_req_ids=frozenset(output.finished_req_ids),
            connector_metadata=metadata,
            scrub_block_ids=frozenset(self._to_scrub),
        )
        self._to_scrub.clear()
        return output, step

    def _allocate_running(self, request: Request, num_new: int, preempted: set[str]) -> bool:
        total = request.num_computed_tokens + num_new
        while self.block_manager.allocate(request, [], total) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        chunks: list[ScheduledChunk],
    ) -> int:
        max_running = self.config.scheduler_config.max_num_seqs
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < max_running:
            request = self.waiting.popleft()
            parked = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
            if parked or self._next_block_is_loading(request):
                skipped.append(request)
                continue
            outcome = self._admit(request, budget)
            if outcome is None:
                skipped.append(request)
                continue
            if outcome < 0:
                self.waiting.appendleft(request)
                if not self.running and not scheduled:
                    # Nothing runs, so nothing will free blocks: they are all held by
                    # requests whose loads landed. Give one back to recompute later.
                    self._release_loaded_request(other_than=request)
                break
            self._schedule_chunk(request, outcome, scheduled, chunks)
            self.running.append(request)
            budget -= outcome
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _next_block_is_loading(self, request: Request) -> bool:
        """Whether the first block `request` lacks is being loaded, or computed from a load.

        The load is a parked request's, or a synchronous one of this step.
        Such a request waits for that load and then shares its blocks, rather
        than loading its own copy: the loaded blocks, and in this step those
        computed after them, enter the prefix cache only once the load is
        known sound (a failed load rolls its request back, and a request
        sharing the blocks would have computed, and saved, KV from garbage).
        """
        if request.request_id in self._loaded_and_ready or not (
            self._loading_hashes or self._unconfirmed_hashes
        ):
            return False
        _blocks, num_local = self.block_manager.find_cached_prefix(request)
        next_index = num_local // self.block_size
        if next_index >= (request.num_tokens - 1) // self.block_size:
            return False  # only the last, always computed, block is missing
        wanted = request.block_hashes[next_index]
        return wanted in self._unconfirmed_hashes or any(
            wanted in hashes for hashes in self._loading_hashes.values()
        )

    def _admit(self, request: Request, budget: int) -> int | None:
        """Allocate for a waiting request; tokens to compute now, None to skip, -1 when full."""
        request_id = request.request_id
        cached_blocks: tuple[list[int], ...] = ()
        num_local = request.num_computed_tokens
        num_external, load_async = 0, False
        if request_id not in self._loaded_and_ready:
            cached_blocks, num_local = self.block_manager.find_cached_prefix(request)
            if self.connector is not None:
                answer, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
                if answer is None:
                    return None  # the connector is still looking: ask again next step
                num_external = self._checked_external(request, answer, load_async)
        computed_after_load = min(num_local + num_external, request.num_tokens - 1)
        num_new = 0 if load_async else min(request.num_tokens - computed_after_load, budget)
        blocks = self.block_manager.allocate(
            request,
            cached_blocks,
            max(num_local + num_external, computed_after_load + num_new),
            computed_after_load,
        )
        if blocks is None:
            return -1
        self._loaded_and_ready.discard(request_id)
        metrics = self.metrics[request_id]
        if metrics.local_cached_tokens is None:
            metrics.local_cached_tokens = num_local
            metrics.external_tokens = computed_after_load - num_local
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, blocks, num_external)
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_local
            self._async_load_targets[request_id] = computed_after_load
            loaded_hashes = request.block_hashes[
                num_local // self.block_size : computed_after_load // self.block_size
            ]
            self._loading_hashes[request_id] = tuple(loaded_hashes)
            return None
        if num_external > 0:
            self._loading_this_step.add(request_id)
            self._unconfirmed_hashes.update(
                request.block_hashes[
                    num_local // self.block_size : (computed_after_load + num_new)
                    // self.block_size
                ]
            )
        request.num_computed_tokens = computed_after_load
        return num_new

    def _checked_external(self, request: Request, answer: object, load_async: bool) -> int:
        name = type(self.connector).__name__
        if not isinstance(answer, int) or isinstance(answer, bool) or answer < 0:
            raise RuntimeError(
                f"{name}.get_num_new_matched_tokens returned {answer!r} for request "
                f"{request.request_id!r}; expected None or an int >= 0"
            )
        if answer == 0 and load_async:
            raise RuntimeError(
                f"{name}.get_num_new_matched_tokens returned (0, True) for request "
                f"{request.request_id!r}; an asynchronous load needs tokens to load"
            )
        return answer

    def _schedule_chunk(
        self,
        request: Request,
        num_new: int,
        scheduled: list[ScheduledRequest],
        chunks: list[ScheduledChunk],
    ) -> None:
        start = request.num_computed_tokens
        is_new = request.request_id not in self._ever_scheduled
        resumed = request.status is RequestStatus.PREEMPTED
        self._ever_scheduled.add(request.request_id)
        request.status = RequestStatus.RUNNING
        # Published now, not after the step: a request admitted later in this
        # step then shares these blocks instead of loading or computing its
        # own copy (requests with a common prefix would otherwise each hold
        # one, and can run the pool dry). Safe because the step writes a
        # block's keys and values before any of its attention reads them;
        # a synchronous load's blocks wait for the step (it may fail).
        if request.request_id not in self._loading_this_step:
            self.block_manager.cache_full_blocks(request, start + num_new)
        block_ids = self.block_manager.group_blocks_of(request.request_id)
        scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                block_ids=block_ids,
                num_computed_tokens=start,
                num_scheduled_tokens=num_new,
                is_new=is_new,
                resumed_from_preemption=resumed,
            )
        )
        chunks.append(
            ScheduledChunk(
                request_id=request.request_id,
                token_ids=tuple(request.all_token_ids[start : start + num_new]),
                start_position=start,
                block_ids=tuple(tuple(group_blocks) for group_blocks in block_ids),
                sample=start + num_new == request.num_tokens,
            )
        )

    def _release_loaded_request(self, other_than: Request) -> None:
        for candidate in reversed(self.waiting):
            if candidate is not other_than and candidate.request_id in self._loaded_and_ready:
                self._loaded_and_ready.discard(candidate.request_id)
                self.waiting.remove(candidate)
                self._preempt(candidate)
                # Behind the request it makes room for, not in front of it.
                self.waiting.remove(candidate)
                self.waiting.append(candidate)
                return

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self.metrics[request.request_id].num_preemptions += 1

    # ------------------------------------------------------------ results

    def update_from_output(self, output: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply the worker's step; the requests that finished in it."""
        connector_output = result.connector_output
        finished: list[Request] = []
        # The step's loads are known now: its blocks are published by
        # _advance (or taken back by a rollback).
        self._loading_this_step.clear()
        self._unconfirmed_hashes.clear()
        invalid = connector_output.invalid_block_ids if connector_output else set()
        # Failed blocks that no load of this step explains belong to a parked
        # request: remembered until it is reported finished receiving.
        self._failed_async_blocks |= invalid
        rolled_back = (
            self._recover_sync_load_errors(output, invalid, finished) if invalid else set()
        )
        now = time.perf_counter()
        for item in output.scheduled:
            request = self.requests[item.request_id]
            if not (request.is_finished or item.request_id in rolled_back):
                token = result.sampled_token_ids.get(item.request_id)
                self._advance(request, item.num_scheduled_tokens, token, now, finished)
        if connector_output is not None:
            for request_id in connector_output.finished_recving or ():
                self._finish_async_load(request_id, finished)
            for request_id in connector_output.finished_sending or ():
                if request_id in self._delayed_free:
                    self._delayed_free.discard(request_id)
                    self.block_manager.free(request_id)
            if self.connector is not None:
                self.connector.update_connector_output(connector_output)
        if self.connector is not None:
            self.kv_events.extend(self.connector.take_events())
        if self._failed_async_blocks:
            parked_blocks = {
                block
                for request_id in self._async_load_targets
                for block in self.block_manager.real_blocks_of(request_id)
            }
            self._failed_async_blocks &= parked_blocks
        return finished

    def add_late_connector_events(self, events: list[KVCacheEvent]) -> None:
        """Worker-side events reported between steps (saves that ended after the last one).

        They reach the connector as a step's would, in an otherwise empty
        `update_connector_output`, and what it then reports joins `kv_events`.
        """
        if self.connector is None or not events:
            return
        self.connector.update_connector_output(KVConnectorOutput(kv_cache_events=list(events)))
        self.kv_events.extend(self.connector.take_events())

    def _advance(
        self,
        request: Request,
        num_computed: int,
        token: int | None,
        now: float,
        finished: list[Request],
    ) -> None:
        """Count a step's computed tokens and its sampled token, if any, for `request`."""
        request.num_computed_tokens += num_computed
        if token is not None:
            request.output_token_ids.append(token)
            metrics = self.metrics[request.request_id]
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            extend_block_hashes(
                request.block_hashes, request.all_token_ids, self.block_size, self.root_hash
            )
        self.block_manager.cache_full_blocks(request)
        if len(request.output_token_ids) >= request.max_tokens:
            self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED, finished)

    def _recover_sync_load_errors(
        self, output: SchedulerOutput, invalid: set[int], finished: list[Request]
    ) -> set[str]:
        affected: set[str] = set()
        for item in output.scheduled:
            request = self.requests[item.request_id]
            computed_blocks = -(-item.num_computed_tokens // self.block_size)
            first_bad, bad = self._first_bad(item.block_ids, computed_blocks, invalid)
            if bad:
                affected.add(item.request_id)
                self._recover(request, first_bad, bad, finished)
        return affected

    def _first_bad(
        self, block_ids: tuple[list[int], ...], num_blocks: int, invalid: set[int]
    ) -> tuple[int, list[int]]:
        """The first of `num_blocks` positions whose block failed in any group, and those."""
        first_bad, bad = num_blocks, []
        for group_blocks in block_ids:
            for index, block in enumerate(group_blocks[:num_blocks]):
                if block in invalid and not self._is_null(block):
                    first_bad = min(first_bad, index)
                    bad.append(block)
        return first_bad, bad

    def _is_null(self, block: int) -> bool:
        return self.block_manager.uses_null_block and block == NULL_BLOCK

    def _finish_async_load(self, request_id: str, finished: list[Request]) -> None:
        request = self.requests.get(request_id)
        if request is None or request_id not in self._async_load_targets:
            logger.warning(
                "the connector reported unknown request %r finished receiving", request_id
            )
            return
        target = self._async_load_targets.pop(request_id)
        self._loading_hashes.pop(request_id, None)
        first_bad, bad = self._first_bad(
            self.block_manager.group_blocks_of(request_id),
            -(-target // self.block_size),
            self._failed_async_blocks,
        )
        request.status = RequestStatus.WAITING
        self._loaded_and_ready.add(request_id)
        if bad:
            request.num_computed_tokens = target
            self._recover(request, first_bad, bad, finished)
        else:
            request.num_computed_tokens = target
            self.block_manager.cache_full_blocks(request)

    def _recover(
        self, request: Request, first_bad_index: int, bad: list[int], finished: list[Request]
    ) -> None:
        """A load into `bad` failed: roll back to the valid prefix, or fail the request."""
        # The failed blocks, and the request's own blocks computed after them
        # (from them) in the same step; never a block it shares: an id a
        # connector got wrong may be another request's, not this load's to clear.
        self._to_scrub.update(bad)
        self._to_scrub |= self.block_manager.own_blocks_from(request.request_id, first_bad_index)
        self.block_manager.invalidate(bad)
        self._failed_async_blocks.difference_update(bad)
        # A sliding-window group may no longer hold the window the shorter
        # prefix needs: resume where every group still holds it.
        first_bad_index = self.block_manager.valid_prefix_blocks(
            request.request_id, first_bad_index
        )
        # Blocks from the first bad one on hold bad data, or data computed from it.
        self.block_manager.uncache_from(request.request_id, first_bad_index)
        metrics = self.metrics[request.request_id]
        metrics.num_load_failures += 1
        # Only the tokens before the failed block were really served by the connector.
        valid_tokens = first_bad_index * self.block_size
        if metrics.external_tokens is not None and metrics.local_cached_tokens is not None:
            metrics.external_tokens = max(
                0, min(metrics.external_tokens, valid_tokens - metrics.local_cached_tokens)
            )
        if self.load_failure_policy == "fail":
            request.error = (
                f"request {request.request_id!r}: the connector failed to load KV blocks "
                f"{sorted(bad)}, and kv_transfer_config.kv_load_failure_policy is 'fail' "
                "(set it to 'recompute' to recompute those tokens instead)"
            )
            self._finish(request, RequestStatus.FINISHED_ERROR, finished)
            return
        logger.info(
            "request %r: load of blocks %s failed; recomputing from token %d",
            request.request_id,
            sorted(bad),
            valid_tokens,
        )
        request.num_computed_tokens = min(request.num_computed_tokens, valid_tokens)

    def _finish(self, request: Request, status: RequestStatus, finished: list[Request]) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._async_load_targets.pop(request.request_id, None)
        self._loading_hashes.pop(request.request_id, None)
        self._loaded_and_ready.discard(request.request_id)
        self.metrics[request.request_id].finish_time = time.perf_counter()
        keep_blocks = False
        block_ids = self.block_manager.group_blocks_of(request.request_id)
        self.block_ids_at_finish[request.request_id] = block_ids
        connector = self.connector
        if connector is not None:
            if supports_hma(connector):
                keep_blocks, params = connector.request_finished_all_groups(  # type: ignore[attr-defined]
                    request, tuple(list(group_blocks) for group_blocks in block_ids)
                )
            else:
                # The HMA gate leaves a connector without SupportsHMA one group.
                keep_blocks, params = connector.request_finished(request, list(block_ids[0]))
            request.kv_transfer_params = params
        if keep_blocks:
            self._delayed_free.add(request.request_id)
        else:
            self.block_manager.free(request.request_id)
        self._finished_since_last_step.add(request.request_id)
        finished.append(request)

    def describe_stuck_requests(self) -> str:
        """What outstanding work waits for, for an error when the connector never reports."""
        parts = [f"{rid!r} waits to finish receiving" for rid in self._async_load_targets]
        parts += [
            f"{request.request_id!r} waits for "
            + (
                "a parked request's load of its prefix"
                if self._next_block_is_loading(request)
                else "free blocks"
            )
            for request in self.waiting
            if request.request_id not in self._async_load_targets
        ]
        parts += [f"{rid!r} waits to finish sending" for rid in sorted(self._delayed_free)]
        return "; ".join(parts) or "nothing"
