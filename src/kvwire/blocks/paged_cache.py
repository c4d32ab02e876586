"""The engine's paged KV caches as a connector's worker half sees them.

The engine registers one tensor per layer, `[2, num_blocks, block_size,
num_kv_heads, head_size]` (kvwire's layout) or vLLM's CPU layout
`[num_blocks, num_kv_heads, block_size, 2 * head_size]` (the block layout's
`cache_layout` says which). Stored blocks use the cross-layer layout
`[num_layers, 2, block_size, num_kv_heads, head_size]` (see
`kvwire.blocks.format`); a vLLM CPU block is copied into its
layer's share of an entry as a whole byte range, whatever its packing.
`PagedKVCaches` checks the registered tensors against the connector's
`kvwire.media.BlockLayout` once, and then copies whole blocks between the caches and
cross-layer tensors without allocating anything.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
from collections.abc import Callable, Mapping, Sequence

import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.common.redaction import shown
from kvwire.config.dtypes import DTYPES
from kvwire.config.kv_cache import KVCacheConfig

# Blocks are copied and checksummed a few at a time, so that the checksum
# reads what the copy has just written (or the copy reads what the check has
# just read) while it is still in the CPU's cache: one trip through memory
# for both instead of two. A few MiB fits the last-level cache of any server
# CPU while keeping the copies large enough that call overhead stays small.
CACHE_CHUNK_BYTES = 4 * 1024 * 1024


class PagedKVCaches:
    """Every layer's paged cache, in layer order, checked against a block layout.

    `layer_order` fixes which cache is layer 0, 1, ... in the cross-layer
    layout (the engine's own order, from its `KVCacheConfig`); layers not in
    it follow in registration order.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layout: BlockLayout,
        layer_order: Sequence[str] = (),
    ) -> None:
        ordered = [name for name in layer_order if name in kv_caches]
        ordered += [name for name in kv_caches if name not in ordered]
        if len(ordered) != layout.num_layers:
            raise ValueError(
                f"register_kv_caches: got {len(ordered)} layers, the model config says "
                f"num_layers={layout.num_layers}"
            )
        expected_dtype = DTYPES[layout.dtype].torch_dtype()
        first = kv_caches[ordered[0]]
        blocks_dim = 0 if layout.cache_layout == "vllm_cpu" else 1
        num_blocks = int(first.shape[blocks_dim]) if first.dim() > blocks_dim else 0
        expected_shape, described = _expected_shape(layout, num_blocks)
        for name in ordered:
            cache = kv_caches[name]
            if tuple(cache.shape) != expected_shape:
                raise ValueError(
                    f"register_kv_caches: layer {name!r} has shape {tuple(cache.shape)}, "
                    f"expected {described}"
                )
            if cache.dtype != expected_dtype:
                raise ValueError(
                    f"register_kv_caches: layer {name!r} has dtype {cache.dtype}, the model "
                    f"config says {layout.dtype}"
                )
        self.layer_names: tuple[str, ...] = tuple(ordered)
        self.num_blocks: int = num_blocks
        # Each layer as [num_blocks, 2, block_size, num_kv_heads, head_size],
        # indexed by block first, so a run of blocks is one slice. kvwire's
        # layout gets a strided view; a vLLM CPU block's bytes are viewed in
        # place as one entry's share (a reinterpretation: the copy moves them
        # as they are, contiguous).
        self._caches: tuple[torch.Tensor, ...] = tuple(
            _block_major(kv_caches[name], layout) for name in ordered
        )

    def check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is outside the cache (0..{self.num_blocks - 1})")

    def holds_block_ids(self, block_ids: Sequence[int]) -> bool:
        """Whether every id is a block of this cache (checked in two passes, not one call each)."""
        return not block_ids or (min(block_ids) >= 0 and max(block_ids) < self.num_blocks)

    def gather_many(
        self, block_ids: Sequence[int], slots: Sequence[int], entries: torch.Tensor
    ) -> None:
        """Copy each block into `entries[slot]` (a cross-layer tensor per slot).

        Consecutive block ids going to consecutive slots move as one strided
        copy per layer, so large transfers cost a few calls, not one per block
        and layer.
        """
        for block_id in block_ids:
            # Slices do not check bounds: an id outside the cache must not
            # silently copy nothing.
            self.check_block_id(block_id)
        for block_start, slot_start, count in _runs(block_ids, slots):
            destination = entries[slot_start : slot_start + count]
            for layer, cache in enumerate(self._caches):
                destination[:, layer].copy_(cache[block_start : block_start + count])

    def scatter_many(
        self, entries: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]
    ) -> None:
        """Copy `entries[slot]` into each block: the reverse of `gather_many`."""
        for block_start, slot_start, count in _runs(block_ids, slots):
            source = entries[slot_start : slot_start + count]
            for layer, cache in enumerate(self._caches):
                cache[block_start : block_start + count].copy_(source[:, layer])


def group_caches(
    kv_caches: Mapping[str, torch.Tensor], layout: BlockLayout, groups: Sequence[CacheGroup]
) -> tuple[PagedKVCaches, ...]:
    """One `PagedKVCaches` per KV cache group, over that group's layers, in group order.

    Layers of different groups may share memory (a hybrid engine gives each
    block id to one group at a time); each group's caches are indexed only
    with that group's block ids.
    """
    grouped = {name for group in groups for name in group.layer_names}
    unknown = [name for name in kv_caches if name not in grouped]
    if unknown:
        raise ValueError(
            f"register_kv_caches: layer {shown(unknown[0])} is in no KV cache group of the "
            f"kv_cache_config ({len(grouped)} layers in {len(groups)} groups)"
        )
    caches = []
    for group in groups:
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(
                f"register_kv_caches: layer {shown(missing[0])} of KV cache group "
                f"{group.index} was not registered"
            )
        layers = {name: kv_caches[name] for name in group.layer_names}
        caches.append(PagedKVCaches(layers, layout, group.layer_names))
    return tuple(caches)


def _expected_shape(layout: BlockLayout, num_blocks: int) -> tuple[tuple[int, ...], str]:
    """The shape a layer's cache must have, and how to say it in an error."""
    if layout.cache_layout == "vllm_cpu":
        return (
            (num_blocks, layout.num_kv_heads, layout.block_size, 2 * layout.head_size),
            f"vLLM's CPU layout [num_blocks, num_kv_heads={layout.num_kv_heads}, "
            f"block_size={layout.block_size}, 2 * head_size={2 * layout.head_size}]",
        )
    return (
        (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size),
        f"[2, num_blocks, block_size={layout.block_size}, "
        f"num_kv_heads={layout.num_kv_heads}, head_size={layout.head_size}]",
    )


def _block_major(cache: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    entry_share = (2, layout.block_size, layout.num_kv_heads, layout.head_size)
    if layout.cache_layout == "vllm_cpu":
        return cache.view(cache.shape[0], *entry_share)
    return cache.transpose(0, 1)


def _runs(block_ids: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first block, first slot, length) of each run where both go up by one."""
    runs: list[tuple[int, int, int]] = []
    for block_id, slot in zip(block_ids, slots, strict=True):
        if runs:
            block_start, slot_start, count = runs[-1]
            if block_id == block_start + count and slot == slot_start + count:
                runs[-1] = (block_start, slot_start, count + 1)
                continue
        runs.append((block_id, slot, 1))
    return runs


def cache_sized_chunks(
    count: int, entry_bytes: int, chunk_bytes: int = CACHE_CHUNK_BYTES
) -> list[range]:
    """Split `count` entries into consecutive ranges of about `chunk_bytes`."""
    per_chunk = max(1, chunk_bytes // entry_bytes)
    return [range(start, min(start + per_chunk, count)) for start in range(0, count, per_chunk)]


def copy_on_this_thread_only() -> None:
    """Make torch copies on the calling thread run on it alone; other threads keep their setting.

    For a connector's background copy threads. With OpenMP, torch splits each
    large copy over every core and waits for the slowest part; several I/O
    threads doing that at once, next to the forward pass, mostly wait for each
    other, and the copies take several times longer. `torch.set_num_threads`
    would also change every thread started later in the process (the engine's
    included), so only this thread's OpenMP setting is changed. Where torch
    does not run on its bundled libgomp this does nothing.
    """
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        torch.get_num_threads()  # torch sets this thread up first, or it would undo ours later
        set_threads(1)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    libraries = sorted((pathlib.Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if not libraries:
        return None
    function: Callable[[int], None] = ctypes.CDLL(str(libraries[0])).omp_set_num_threads
    return function


def check_cache_layout(layout: BlockLayout, kv_cache_config: KVCacheConfig) -> None:
    """Raise unless every cache group has the block layout the engine config describes."""
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        found = (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
        expected = (layout.block_size, layout.num_kv_heads, layout.head_size, layout.dtype)
        if found != expected:
            raise ValueError(
                "kv_cache_config: a group has (block_size, num_kv_heads, head_size, dtype) = "
                f"{found}, the engine config says {expected}"
            )
