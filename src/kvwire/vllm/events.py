"""kvwire's KV cache events on their way through vLLM, and as vLLM's events at the end.

The worker half hands kvwire's events (picklable records) to vLLM in a
`KVWireKVEvents`; vLLM carries it to the scheduler half in the step's
`KVConnectorOutput`, where the wrapped connector takes them back. What the
scheduler half's `take_events` reports is vLLM's `BlockStored` /
`BlockRemoved`, with vLLM's block hashes (kvwire keys blocks by them) and,
for the blocks of requests the connector saw, their token ids and parent
hash (`BlockTokens`). A LoRA adapter's blocks, which kvwire keys by
vLLM's hash folded with the adapter's key, are reported by vLLM's hash and
the adapter's id and name, as vLLM reports its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from kvwire.interface.types import BlockHash
from kvwire.interface.types import BlockRemoved as KVWireBlockRemoved
from kvwire.interface.types import BlockStored as KVWireBlockStored
from kvwire.interface.types import KVCacheEvent as KVWireEvent

# kvwire's media as vLLM names them; others keep kvwire's name, upper-cased.
_MEDIA = {"cpu": MEDIUM_CPU, "disk": MEDIUM_STORAGE}


class KVWireKVEvents(KVConnectorKVEvents):
    """kvwire's events from the workers of one engine, for the scheduler half.

    vLLM's output aggregator concatenates every rank's (`add_events`);
    `EveryRank` then keeps a block stored once all ranks stored it.
    """

    def __init__(self, events: Sequence[KVWireEvent] = (), num_workers: int = 1) -> None:
        self._events: list[Any] = list(events)
        self._num_workers = num_workers

    def add_events(self, events: list[Any]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVWireKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events = []

    def __repr__(self) -> str:
        return f"<KVWireKVEvents: {len(self._events)} events>"


@attrs.frozen
class _Block:
    """A block as vLLM names it: its hash, its parent's, its tokens, its LoRA adapter."""

    block_hash: BlockHash
    parent: BlockHash | None
    tokens: list[int]
    lora_id: int | None = None
    lora_name: str | None = None


class BlockTokens:
    """The token ids and parent hash of recently seen blocks, to fill vLLM's `BlockStored`.

    Bounded: the oldest entries go first; an event for a block no longer
    remembered carries no token ids.
    """

    def __init__(self, block_size: int, capacity: int = 65536) -> None:
        self._block_size = block_size
        self._capacity = capacity
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()

    def remember(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        start: int,
        *,
        keys: Sequence[BlockHash] | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Remember blocks `start..` of a request (its hashes and all its token ids).

        `keys`: what the connector keys each block by, when not vLLM's hash
        (a LoRA adapter's request, whose `lora_id` and `lora_name` are given).
        """
        size = self._block_size
        keys = block_hashes if keys is None else keys
        for index in range(start, min(len(block_hashes), len(keys))):
            tokens = list(token_ids[index * size : (index + 1) * size])
            if len(tokens) < size:
                break
            parent = block_hashes[index - 1] if index else None
            self._blocks[keys[index]] = _Block(
                block_hashes[index], parent, tokens, lora_id, lora_name
            )
            self._blocks.move_to_end(keys[index])
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)

    def to_vllm(self, events: Iterable[KVWireEvent]) -> list[KVCacheEvent]:
        """kvwire's events as vLLM's, one vLLM event per block stored (each has its tokens)."""
        converted: list[KVCacheEvent] = []
        for event in events:
            medium = _MEDIA.get(event.medium, event.medium.upper())
            if isinstance(event, KVWireBlockRemoved):
                converted.append(
                    BlockRemoved(
                        block_hashes=[self._vllm_hash(key) for key in event.block_hashes],
                        medium=medium,
                        group_idx=event.group,
                    )
                )
            elif isinstance(event, KVWireBlockStored):
                converted.extend(
                    self._stored(block_hash, medium, event.group)
                    for block_hash in event.block_hashes
                )
        return converted

    def _vllm_hash(self, key: BlockHash) -> BlockHash:
        block = self._blocks.get(key)
        return key if block is None else block.block_hash

    def _stored(self, key: BlockHash, medium: str, group: int | None) -> BlockStored:
        block = self._blocks.get(key) or _Block(key, None, [])
        return BlockStored(
            block_hashes=[block.block_hash],
            parent_block_hash=block.parent,
            token_ids=block.tokens,
            block_size=self._block_size,
            lora_id=block.lora_id,
            medium=medium,
            lora_name=block.lora_name,
            group_idx=group,
        )
