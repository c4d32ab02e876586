"""An engine worker's paged KV cache: its layers' tensors, and each layer's KV cache group."""

from __future__ import annotations

import attrs
import torch

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import LAYER_NAME_FORMAT, KVCacheConfig
from kvwire.engine.model import torch_dtype
from kvwire.engine.parallel import RankShare


@attrs.frozen(eq=False)
class PagedKVCache:
    """The KV cache tensors of a worker's layers, `[2, blocks, block_size, kv_heads, head_size]`.

    `layers` and `layer_names` are in model order (the cache config lists
    layers group by group); `layer_groups[i]` is layer `i`'s KV cache group.
    """

    layers: range
    layer_names: tuple[str, ...]
    layer_groups: tuple[int, ...]
    num_groups: int
    tensors: dict[str, torch.Tensor]
    """By layer name: layers of different groups share a tensor (their block ids never overlap)."""


def allocate_paged_cache(
    config: EngineConfig, kv_cache_config: KVCacheConfig, share: RankShare | None = None
) -> PagedKVCache:
    """Zeroed tensors laid out as `kv_cache_config` says, for the whole model or a rank's `share`.

    One tensor per `KVCacheTensor`, as in vLLM's HMA. Raises `ValueError`
    when `kv_cache_config` names other layers than the worker holds.
    """
    model_config = config.model_config
    layers = range(model_config.num_layers) if share is None else share.layers
    layer_names = tuple(LAYER_NAME_FORMAT.format(index) for index in layers)
    group_of = {
        name: group
        for group, spec in enumerate(kv_cache_config.kv_cache_groups)
        for name in spec.layer_names
    }
    if sorted(group_of) != sorted(layer_names):
        raise ValueError(
            f"kv_cache_config names layers {sorted(group_of)}, but the model has "
            f"{list(layer_names)}"
        )
    shape = (
        2,
        kv_cache_config.num_blocks,
        config.cache_config.block_size,
        model_config.num_kv_heads if share is None else len(share.kv_heads),
        model_config.head_size,
    )
    dtype = torch_dtype(model_config.dtype)
    shared: dict[str, torch.Tensor] = {}
    for cache_tensor in kv_cache_config.kv_cache_tensors:
        tensor = torch.zeros(shape, dtype=dtype)
        for name in cache_tensor.shared_by:
            shared[name] = tensor
    return PagedKVCache(
        layers=layers,
        layer_names=layer_names,
        layer_groups=tuple(group_of[name] for name in layer_names),
        num_groups=len(kv_cache_config.kv_cache_groups),
        tensors={name: shared[name] for name in layer_names},
    )
