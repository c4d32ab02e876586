"""What the engine and a connector hand each other.

These records are the contract between an inference engine's scheduler and
worker and the connectors they drive. None of them needs torch; everything a
worker receives from the scheduler is picklable, because the two may live in
different processes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

BlockHash = bytes
"""A chained block hash: digest of (parent hash, the block's token ids, extra keys)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


@attrs.define(eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    `block_hashes` holds the chained hash of every *full* block of
    `all_token_ids`; the engine appends to it as blocks fill up.
    `num_computed_tokens` counts tokens whose KV is in the engine's cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = attrs.field(factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = attrs.field(factory=list)
    status: RequestStatus = RequestStatus.WAITING
    kv_transfer_params: dict[str, Any] | None = None
    # Set when the request ends with an error (e.g. a load failure under the
    # "fail" policy): the message names the request and the blocks.
    error: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


@attrs.frozen
class KVCacheBlocks:
    """The blocks allocated to one request, one list of block ids per KV cache group."""

    block_ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.block_ids

    @classmethod
    def empty(cls, num_groups: int = 1) -> KVCacheBlocks:
        return cls(tuple([] for _ in range(num_groups)))


@attrs.frozen
class ScheduledRequest:
    """One request's share of a step.

    `block_ids` are all of the request's blocks after this step's
    allocation; `num_computed_tokens` is what was computed before the step
    (loaded tokens included); the step computes `num_scheduled_tokens` more.
    """

    request_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    is_new: bool
    resumed_from_preemption: bool = False


@attrs.define
class SchedulerOutput:
    """What one scheduling step decided; the connector must not modify it."""

    scheduled: list[ScheduledRequest] = attrs.field(factory=list)
    finished_req_ids: set[str] = attrs.field(factory=set)
    preempted_req_ids: set[str] = attrs.field(factory=set)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {item.request_id: item.num_scheduled_tokens for item in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(item.num_scheduled_tokens for item in self.scheduled)


@attrs.frozen
class ForwardContext:
    """What the worker knows about the forward pass it is about to run.

    `attn_metadata` is the engine's attention metadata (slot mappings, block
    tables); connectors that drive their transfers from their own metadata
    may ignore it.
    """

    layer_names: tuple[str, ...]
    attn_metadata: Any = None


@attrs.define
class KVConnectorStats:
    """Counters a connector reports; merged across workers and steps.

    `data` maps a counter name to a number, or to a nested `dict` for a
    composite connector's children. Merging adds numbers key by key.
    """

    data: dict[str, Any] = attrs.field(factory=dict)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = _merge_counters(self.data, other.data)
        return self

    def reduce(self) -> dict[str, Any]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data

    def reset(self) -> None:
        self.data = {}


def _merge_counters(left: Mapping[str, Any], right: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(left)
    for key, value in right.items():
        if key not in merged:
            merged[key] = value
        elif isinstance(value, Mapping):
            merged[key] = _merge_counters(merged[key], value)
        else:
            merged[key] = merged[key] + value
    return merged


@attrs.frozen
class BlockStored:
    """Blocks became available in a connector's store (`medium` names it).

    `group`: the KV cache group whose blocks they are (on a hybrid model a
    block hash names one entry per group); None when the store cannot tell.
    """

    block_hashes: tuple[BlockHash, ...]
    medium: str
    group: int | None = None


@attrs.frozen
class BlockRemoved:
    """Blocks were evicted from or invalidated in a connector's store (`group` as stored)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str
    group: int | None = None


KVCacheEvent = BlockStored | BlockRemoved


@attrs.define
class KVConnectorOutput:
    """The worker half's report for one step, merged over workers.

    `kv_connector_worker_meta` is what the workers' `build_connector_worker_meta`
    returned, merged with its `aggregate` (None when no worker returned any).
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: KVConnectorStats | None = None
    invalid_block_ids: set[int] = attrs.field(factory=set)
    kv_cache_events: list[KVCacheEvent] = attrs.field(factory=list)
    kv_connector_worker_meta: Any = None

    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or (self.kv_connector_stats and not self.kv_connector_stats.is_empty())
            or self.invalid_block_ids
            or self.kv_cache_events
            or self.kv_connector_worker_meta is not None
        )


@attrs.define
class KVConnectorTransferResults:
    """One worker's finished transfers, in one snapshot.

    A failed receive is in `failed_recving` and in `finished_recving`
    too, so that the scheduler stops waiting for the request.
    """

    finished_sending: set[str] = attrs.field(factory=set)
    finished_recving: set[str] = attrs.field(factory=set)
    failed_recving: set[str] = attrs.field(factory=set)


class CacheHitSource(enum.Enum):
    """Where tokens found outside the engine's own cache came from (for hit metrics)."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"
