"""The engine's KV cache blocks as byte ranges, for I/O straight into and out of the cache.

A stored entry's payload is one block of every layer of a KV cache group, in
layer order, each layer's share as the cache holds it (see
`PAYLOAD_LAYOUTS`). In the cache, one
layer's block is a few contiguous byte ranges: the tensor's dimensions after
the block dimension are contiguous, so block `b` occupies, for each index of
the dimensions before the block dimension (a "plane"), one range. kvwire's
layout `[2, num_blocks, block_size, heads, head_size]` has two planes per
layer (keys, values); vLLM's CPU layout `[num_blocks, heads, block_size,
2 * head_size]` has one. A block's ranges, layer after layer and plane after
plane, are therefore exactly its entry's payload, byte for byte: a store can
read an entry's payload straight into them (`preadv`, `recv_into`) and
write it straight from them (`pwritev`, `sendmsg`), with no copy in
between and no change to the stored format.

`BlockMemory` makes one writable `memoryview` per plane when the
caches are registered; a block's ranges are slices of those, so moving a
block allocates no buffer. The views point into the tensors' memory: they
stay valid while the `BlockMemory` (which holds the tensors) lives.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence

import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.paged_cache import PagedKVCaches, group_caches
from kvwire.common.redaction import shown

# The block dimension of each declared cache layout (`BlockLayout.cache_layout`).
BLOCK_DIMENSIONS: dict[str, int] = {"kvwire": 1, "vllm_cpu": 0}


class BlockMemory:
    """One KV cache group's blocks as byte ranges of its layers' tensors, in payload order.

    The tensors are checked as `PagedKVCaches`
    checks them (layer count, shape of the declared layout, dtype); besides,
    they must live in CPU memory and be contiguous after the block dimension.
    `layer_order` fixes which layer comes first in a payload (the engine's
    order); layers not in it follow in registration order.

    `heads` (indices into the caches' KV heads) makes the ranges those of
    these heads only, an entry of a group of heads (see
    `kvwire.blocks.shards`): in vLLM's CPU layout a head's share of a
    block is one range, in kvwire's one range per token; all heads by default.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layout: BlockLayout,
        layer_order: Sequence[str] = (),
        heads: range | None = None,
    ) -> None:
        checked = PagedKVCaches(kv_caches, layout, layer_order)
        self.layer_names: tuple[str, ...] = checked.layer_names
        self.num_blocks: int = checked.num_blocks
        all_heads = layout.num_kv_heads
        heads = range(all_heads) if heads is None else heads
        if not (heads and heads.step == 1 and heads.start >= 0 and heads.stop <= all_heads):
            raise ValueError(
                f"BlockMemory: heads {heads} are not a range of the caches' {all_heads} KV heads"
            )
        self.payload_bytes: int = layout.payload_bytes * len(heads) // all_heads
        block_dim = BLOCK_DIMENSIONS[layout.cache_layout]
        # Held so that the planes' memory stays allocated while they are in use.
        self._tensors = tuple(kv_caches[name] for name in self.layer_names)
        planes: list[tuple[memoryview, int]] = []
        for name, tensor in zip(self.layer_names, self._tensors, strict=True):
            planes.extend(_planes(name, tensor, block_dim))
        self._planes = tuple(view for view, _ in planes)
        self._block_strides = tuple(stride for _, stride in planes)
        plane_bytes = layout.payload_bytes // len(self._planes) if self._planes else 0
        # Where the heads lie in one plane's block, as (offset, size) pairs.
        if len(heads) == all_heads:
            self._pieces: tuple[tuple[int, int], ...] = ((0, plane_bytes),)
        elif layout.cache_layout == "vllm_cpu":  # [heads, block_size, 2 * head_size]
            per_head = plane_bytes // all_heads
            self._pieces = ((heads.start * per_head, len(heads) * per_head),)
        else:  # [block_size, heads, head_size]
            per_head = plane_bytes // (layout.block_size * all_heads)
            self._pieces = tuple(
                ((token * all_heads + heads.start) * per_head, len(heads) * per_head)
                for token in range(layout.block_size)
            )

    def check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is outside the cache (0..{self.num_blocks - 1})")

    def ranges(self, block_id: int) -> list[memoryview]:
        """Block `block_id`'s bytes, writable, in payload order (layer, then plane).

        Slices of views made at registration: no buffer is allocated. An id
        outside the cache is an `IndexError`, never an empty range.
        """
        self.check_block_id(block_id)
        return [
            plane[block_id * stride + offset : block_id * stride + offset + size]
            for plane, stride in zip(self._planes, self._block_strides, strict=True)
            for offset, size in self._pieces
        ]


def group_memories(
    kv_caches: Mapping[str, torch.Tensor], layout: BlockLayout, groups: Sequence[CacheGroup]
) -> tuple[BlockMemory, ...]:
    """One `BlockMemory` per KV cache group, over that group's layers, in group order.

    The groups are checked as `group_caches`
    checks them (every layer in exactly one group, every group's layers registered).
    """
    group_caches(kv_caches, layout, groups)
    return tuple(
        BlockMemory(
            {name: kv_caches[name] for name in group.layer_names}, layout, group.layer_names
        )
        for group in groups
    )


def _planes(name: str, tensor: torch.Tensor, block_dim: int) -> list[tuple[memoryview, int]]:
    """Each plane of `tensor` as a writable byte view from its first block, and its block stride.

    A plane is one index of the dimensions before `block_dim`; its view
    spans every block, so a block's range is a slice at `block * stride`.
    """
    if tensor.device.type != "cpu":
        raise ValueError(
            f"register_kv_caches: layer {shown(name)} is on {tensor.device}; this connector "
            "moves blocks of KV caches in CPU memory only"
        )
    itemsize = tensor.element_size()
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    expected = 1
    for dim in reversed(range(block_dim + 1, len(shape))):
        if shape[dim] != 1 and strides[dim] != expected:
            raise ValueError(
                f"register_kv_caches: layer {shown(name)} has strides {strides} for shape {shape}; "
                f"expected the dimensions after the block dimension ({block_dim}) contiguous"
            )
        expected *= shape[dim]
    block_bytes = expected * itemsize
    num_blocks = shape[block_dim]
    block_stride = strides[block_dim] * itemsize
    if num_blocks > 1 and block_stride < block_bytes:
        raise ValueError(
            f"register_kv_caches: layer {shown(name)}'s blocks overlap "
            f"(stride {strides[block_dim]} elements, a block is {expected}); "
            "expected one block after another"
        )
    span = (num_blocks - 1) * block_stride + block_bytes if num_blocks else 0
    base = tensor.data_ptr()
    planes = []
    outer = shape[:block_dim]
    for index in range(math.prod(outer)):
        offset = 0
        rest = index
        for dim in reversed(range(block_dim)):
            rest, position = divmod(rest, outer[dim])
            offset += position * strides[dim] * itemsize
        memory = (ctypes.c_ubyte * span).from_address(base + offset) if span else bytearray()
        planes.append((memoryview(memory).cast("B"), block_stride))
    return planes
