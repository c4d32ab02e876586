"""vLLM's scheduler-side objects as kvwire's connectors expect them.

- `RequestView`: a vLLM request read live, so that kvwire's planner,
  which keeps the request and re-reads `block_hashes` and `num_tokens`
  each step, sees the hashes vLLM appends as blocks fill up. vLLM's block
  hashes (32-byte sha256 values, the same in every process) are the keys
  as they are; the layout fingerprint namespaces them in the store. A
  request with a LoRA adapter gets its hashes folded with the adapter's
  key (`kvwire.identity.adapter_keys`): vLLM's hash names the adapter only by
  its name and path. One with an adapter kvwire cannot identify offers no
  hash: nothing is looked up or saved for it. The workers receive the
  keys the scheduler half planned with, in the step's metadata.
- `RequestViews`: one view per request, its adapter's key decided
  when it is first seen.
- `BlockTables`: vLLM sends each request's block ids once and then
  only the new ones (a resumed request gets its whole list again); kvwire's
  connectors want every step's full lists. It also turns vLLM's
  `SchedulerOutput` into kvwire's. On a hybrid cache the lists are read
  from vLLM's live block table instead: vLLM frees the blocks that leave a
  sliding window without telling the workers, so lists kept from the deltas
  would still name blocks that another request may hold by now.
- `AllocationFilter`: vLLM calls `update_state_after_alloc` twice
  for an asynchronous load (the load's blocks, then, once the load is done,
  all blocks with 0 external tokens); kvwire's connectors plan once per
  allocation, so the second call is not passed on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs

from kvwire.identity.adapter_keys import AdapterKeys, fold_block_hash
from kvwire.interface.types import (
    BlockHash,
    Request,
    RequestStatus,
    ScheduledRequest,
    SchedulerOutput,
)

_STATUSES = {status.name: status for status in RequestStatus}


class RequestView:
    """kvwire's `kvwire.Request`, read from a vLLM request when asked.

    Only what kvwire's connectors read is offered; every attribute reflects
    the vLLM request at the moment it is read. `adapter_key`: the key of
    the request's LoRA adapter, folded into each of its block hashes; None
    for a request without one. `shares`: False for a request whose
    adapter kvwire cannot identify; it offers no block hash.
    """

    __slots__ = ("_adapter_key", "_folded", "_request", "shares")

    def __init__(
        self, vllm_request: Any, adapter_key: bytes | None = None, *, shares: bool = True
    ) -> None:
        self._request = vllm_request
        self._adapter_key = adapter_key
        # The folded hashes so far: vLLM only ever appends to its list.
        self._folded: list[BlockHash] = []
        self.shares = shares

    @property
    def vllm_request(self) -> Any:
        return self._request

    @property
    def request_id(self) -> str:
        return str(self._request.request_id)

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._request.prompt_token_ids or ())

    @property
    def block_hashes(self) -> list[BlockHash]:
        # vLLM appends to this very list as blocks fill up.
        hashes: list[BlockHash] = self._request.block_hashes
        if not self.shares:
            return []
        if self._adapter_key is None:
            return hashes
        folded = self._folded
        if len(hashes) < len(folded):
            folded.clear()
        folded.extend(
            fold_block_hash(self._adapter_key, block_hash) for block_hash in hashes[len(folded) :]
        )
        return folded

    @property
    def num_tokens(self) -> int:
        return int(self._request.num_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self._request.num_prompt_tokens)

    @property
    def num_computed_tokens(self) -> int:
        return int(self._request.num_computed_tokens)

    @property
    def status(self) -> RequestStatus:
        name = self._request.status.name
        status = _STATUSES.get(name)
        if status is not None:
            return status
        # vLLM's statuses kvwire has no name for (FINISHED_REPETITION, waiting
        # for a grammar, ...): a finished one must still read as finished.
        return (
            RequestStatus.FINISHED_STOPPED if name.startswith("FINISHED") else RequestStatus.WAITING
        )

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        params: dict[str, Any] | None = self._request.kv_transfer_params
        return params

    def as_request(self) -> Request:
        """This view, typed as kvwire's `Request` (it offers what connectors read of one)."""
        return cast(Request, self)


class RequestViews:
    """One `RequestView` per request the scheduler half holds, until it finishes.

    A request's adapter key is decided when its view is made, so every
    lookup and save of the request uses the same keys. `adapter_keys`
    identifies adapters (None: an engine that serves none).
    """

    def __init__(self, adapter_keys: AdapterKeys | None) -> None:
        self._adapter_keys = adapter_keys
        self._views: dict[str, RequestView] = {}

    def view(self, vllm_request: Any) -> RequestView:
        """The view of `vllm_request`, made the first time it is asked for."""
        request_id = str(vllm_request.request_id)
        view = self._views.get(request_id)
        if view is not None and view.vllm_request is vllm_request:
            return view
        view = self._new_view(vllm_request)
        self._views[request_id] = view
        return view

    def forget(self, request_id: str) -> None:
        self._views.pop(request_id, None)

    def _new_view(self, vllm_request: Any) -> RequestView:
        adapter = getattr(vllm_request, "lora_request", None)
        if not adapter:
            return RequestView(vllm_request)
        key = (
            self._adapter_keys.key(
                int(adapter.lora_int_id), str(adapter.lora_name), str(adapter.lora_path)
            )
            if self._adapter_keys is not None
            else None
        )
        return RequestView(vllm_request, key, shares=key is not None)

    def __len__(self) -> int:
        return len(self._views)


LiveBlockIds = Callable[[str], tuple[list[int], ...]]
"""A request's block ids now, a list per KV cache group (`KVCacheManager.get_block_ids`)."""


class BlockTables:
    """Every scheduled request's full block id lists, kept from vLLM's deltas."""

    def __init__(self) -> None:
        self._block_ids: dict[str, tuple[list[int], ...]] = {}

    def to_kvwire(
        self, scheduler_output: Any, live_block_ids: LiveBlockIds | None = None
    ) -> SchedulerOutput:
        """kvwire's `SchedulerOutput` for vLLM's, with full block lists.

        With `live_block_ids` (a hybrid cache), each scheduled request's
        lists are what it returns (positions that left a sliding window hold
        the null block, 0), not the lists kept from the deltas.
        """
        scheduled: list[ScheduledRequest] = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = tuple(list(group) for group in new.block_ids)
            self._block_ids[new.req_id] = block_ids
            scheduled.append(
                ScheduledRequest(
                    request_id=new.req_id,
                    block_ids=block_ids,
                    num_computed_tokens=new.num_computed_tokens,
                    num_scheduled_tokens=num_scheduled[new.req_id],
                    is_new=True,
                )
            )
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            resumed = request_id in cached.resumed_req_ids
            block_ids = self._apply(request_id, cached.new_block_ids[index], resumed)
            scheduled.append(
                ScheduledRequest(
                    request_id=request_id,
                    block_ids=block_ids,
                    num_computed_tokens=cached.num_computed_tokens[index],
                    num_scheduled_tokens=num_scheduled[request_id],
                    is_new=False,
                    resumed_from_preemption=resumed,
                )
            )
        finished = set(scheduler_output.finished_req_ids)
        preempted = set(scheduler_output.preempted_req_ids or ())
        # A preempted request comes back as resumed, with all its blocks (in
        # the same step when vLLM preempts everything to reset its cache).
        for request_id in (finished | preempted) - {item.request_id for item in scheduled}:
            self._block_ids.pop(request_id, None)
        if live_block_ids is not None:
            scheduled = [
                attrs.evolve(item, block_ids=live_block_ids(item.request_id)) for item in scheduled
            ]
        return SchedulerOutput(
            scheduled=scheduled, finished_req_ids=finished, preempted_req_ids=preempted
        )

    def _apply(
        self, request_id: str, new_block_ids: tuple[list[int], ...] | None, resumed: bool
    ) -> tuple[list[int], ...]:
        known = self._block_ids.get(request_id)
        if resumed or known is None:
            if new_block_ids is None:
                raise ValueError(
                    f"SchedulerOutput: request {request_id!r} is scheduled again without its "
                    "block ids, and they were never sent"
                )
            block_ids = tuple(list(group) for group in new_block_ids)
        elif new_block_ids is None:
            block_ids = known
        else:
            block_ids = tuple([*old, *new] for old, new in zip(known, new_block_ids, strict=True))
        self._block_ids[request_id] = block_ids
        return block_ids

    def __len__(self) -> int:
        return len(self._block_ids)


class AllocationFilter:
    """Which of vLLM's `update_state_after_alloc` calls to pass on to a kvwire connector."""

    def __init__(self) -> None:
        self._async_lookups: set[str] = set()
        self._loading_async: set[str] = set()

    def looked_up(self, request_id: str, load_async: bool) -> None:
        """Note what `get_num_new_matched_tokens` answered for the request."""
        if load_async:
            self._async_lookups.add(request_id)
        else:
            self._async_lookups.discard(request_id)

    def should_forward(self, request_id: str, num_external_tokens: int) -> bool:
        """False for the second call vLLM makes once an asynchronous load has finished."""
        if request_id in self._loading_async:
            self._loading_async.discard(request_id)
            if num_external_tokens == 0:
                return False
        if request_id in self._async_lookups and num_external_tokens > 0:
            self._loading_async.add(request_id)
        self._async_lookups.discard(request_id)
        return True

    def loading_async(self, request_id: str) -> bool:
        """Whether the request's blocks wait for an asynchronous load passed on."""
        return request_id in self._loading_async

    def forget(self, request_id: str) -> None:
        self._async_lookups.discard(request_id)
        self._loading_async.discard(request_id)
