"""kvwire's KV cache events on their way through vLLM, and as vLLM's events at the end.

The worker side hands kvwire's events (picklable records) to vLLM in a
:class:`KVWireKVEvents`; vLLM carries it to the scheduler side in the step's
``KVConnectorOutput``, where the wrapped connector takes them back. What the
scheduler side's ``take_events`` reports is vLLM's ``BlockStored`` /
``BlockRemoved``, with vLLM's block hashes (kvwire keys blocks by them) and,
for the blocks of requests the connector saw, their token ids and parent
hash (:class:`BlockTokens`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

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
    """kvwire's events from the workers of one engine, for the scheduler side.

    vLLM's output aggregator concatenates every rank's (``add_events``);
    :class:`~kvwire.ranks.EveryRank` then keeps a block stored once all ranks stored it.
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


class BlockTokens:
    """The token ids and parent hash of recently seen blocks, to fill vLLM's ``BlockStored``.

    Bounded: the oldest entries go first; an event for a block no longer
    remembered carries no token ids.
    """

    def __init__(self, block_size: int, capacity: int = 65536) -> None:
        self._block_size = block_size
        self._capacity = capacity
        self._blocks: OrderedDict[BlockHash, tuple[BlockHash | None, list[int]]] = OrderedDict()

    def remember(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int
    ) -> None:
        """Remember blocks ``start..`` of a request (its hashes and all its token ids)."""
        size = self._block_size
        for index in range(start, len(block_hashes)):
            tokens = list(token_ids[index * size : (index + 1) * size])
            if len(tokens) < size:
                break
            parent = block_hashes[index - 1] if index else None
            self._blocks[block_hashes[index]] = (parent, tokens)
            self._blocks.move_to_end(block_hashes[index])
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
                        block_hashes=list(event.block_hashes), medium=medium, group_idx=event.group
                    )
                )
            elif isinstance(event, KVWireBlockStored):
                converted.extend(
                    self._stored(block_hash, medium, event.group)
                    for block_hash in event.block_hashes
                )
        return converted

    def _stored(self, block_hash: BlockHash, medium: str, group: int | None) -> BlockStored:
        parent, tokens = self._blocks.get(block_hash, (None, []))
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=self._block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=group,
        )
