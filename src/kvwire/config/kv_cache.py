"""How the engine's KV cache memory is laid out, once it has been sized.

The engine builds a `kvwire.KVCacheConfig` after it has measured how many
blocks fit; connectors receive it as their third constructor argument. More
than one `KVCacheGroupSpec` (full-attention layers beside
sliding-window layers) is what the hybrid KV cache manager serves.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
from attrs import validators

from kvwire.common.redaction import shown
from kvwire.config.dtypes import DTYPES, check_dtype
from kvwire.config.engine_config import EngineConfig

LAYER_NAME_FORMAT = "layers.{}.attn"
"""How the engine names layer `i` in its cache config and its `kv_caches`."""


def _positive(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {shown(value)}")


@attrs.frozen(kw_only=True)
class AttentionSpec:
    """The KV layout of one attention layer: tokens per block and per-token shape."""

    block_size: int = attrs.field(validator=[validators.instance_of(int), _positive])
    num_kv_heads: int = attrs.field(validator=[validators.instance_of(int), _positive])
    head_size: int = attrs.field(validator=[validators.instance_of(int), _positive])
    dtype: str = attrs.field(default="float32", validator=check_dtype)

    @property
    def dtype_size(self) -> int:
        return DTYPES[self.dtype].size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: keys and values."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size


@attrs.frozen(kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that attends to every previous token."""


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer that attends to the last `sliding_window` tokens only."""

    sliding_window: int = attrs.field(validator=[validators.instance_of(int), _positive])


@attrs.frozen(kw_only=True)
class KVCacheTensor:
    """One allocation of `size_bytes`, shared by the layers named in `shared_by`."""

    size_bytes: int = attrs.field(validator=[validators.instance_of(int), _positive])
    shared_by: list[str] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class KVCacheGroupSpec:
    """Layers that share one block table because they share one spec."""

    layer_names: list[str]
    kv_cache_spec: AttentionSpec


@attrs.frozen(kw_only=True)
class KVCacheConfig:
    """The sized KV cache: blocks per layer, the tensors, and the groups."""

    num_blocks: int = attrs.field(validator=[validators.instance_of(int), _positive])
    kv_cache_tensors: list[KVCacheTensor] = attrs.field(factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = attrs.field(factory=list)

    @property
    def layer_names(self) -> list[str]:
        return [name for group in self.kv_cache_groups for name in group.layer_names]

    @property
    def is_hybrid(self) -> bool:
        return len(self.kv_cache_groups) > 1


def build_full_attention_kv_cache_config(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: str,
    layer_name_format: str = LAYER_NAME_FORMAT,
) -> KVCacheConfig:
    """A single-group cache config: every layer full attention, one tensor per layer."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    return _one_group_config(spec, num_layers, num_blocks, layer_name_format)


def _one_group_config(
    spec: FullAttentionSpec, num_layers: int, num_blocks: int, layer_name_format: str
) -> KVCacheConfig:
    names = [layer_name_format.format(index) for index in range(num_layers)]
    tensors = [
        KVCacheTensor(size_bytes=spec.page_size_bytes * num_blocks, shared_by=[name])
        for name in names
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
    )


def sliding_window_of(spec: AttentionSpec) -> int | None:
    """The window of a sliding-window spec, None for full attention."""
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def build_kv_cache_config(config: EngineConfig, hma_enabled: bool | None = None) -> KVCacheConfig:
    """The kvwire engine's cache layout for `config`; layer `i` is `layers.{i}.attn`.

    `hma_enabled` is the HMA gate's decision (None: on unless
    `scheduler_config.disable_hybrid_kv_cache_manager` is true). With HMA on,
    a hybrid model gets one `KVCacheGroupSpec` per kind of layer, full
    attention first, then sliding window; otherwise (HMA off, or no
    sliding-window layer) one group of every layer with a
    `FullAttentionSpec`, as vLLM does when HMA is off.

    Every group holds the same number of layers, as in vLLM: each
    kind's layers (in model order) are cut into groups of the greatest common
    divisor of the kinds' layer counts (5 sliding and 1 full layers: six
    groups of one layer). Group `g`'s `j`-th layer shares its
    `KVCacheTensor` with the `j`-th layer of every other group, and
    all groups draw block ids from one pool of `num_blocks`.
    """
    model, cache = config.model_config, config.cache_config
    if hma_enabled is None:
        hma_enabled = config.scheduler_config.disable_hybrid_kv_cache_manager is not True
    full_spec = FullAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        dtype=model.dtype,
    )
    if not (hma_enabled and model.is_hybrid):
        return _one_group_config(
            full_spec, model.num_layers, cache.num_gpu_blocks, LAYER_NAME_FORMAT
        )
    full = [i for i in range(model.num_layers) if model.layer_window(i) is None]
    sliding = [i for i in range(model.num_layers) if model.layer_window(i) is not None]
    assert model.sliding_window is not None  # a hybrid model's config demands it
    # A sliding-window layer's block is shaped as a full-attention layer's.
    sliding_spec = SlidingWindowSpec(sliding_window=model.sliding_window, **attrs.asdict(full_spec))
    kinds: list[tuple[list[int], AttentionSpec]] = [(full, full_spec), (sliding, sliding_spec)]
    group_size = math.gcd(len(full), len(sliding))
    groups = [
        KVCacheGroupSpec(
            layer_names=[LAYER_NAME_FORMAT.format(i) for i in layers[start : start + group_size]],
            kv_cache_spec=spec,
        )
        for layers, spec in kinds
        for start in range(0, len(layers), group_size)
    ]
    page_size = groups[0].kv_cache_spec.page_size_bytes
    tensors = [
        KVCacheTensor(
            size_bytes=page_size * cache.num_gpu_blocks,
            shared_by=[group.layer_names[slot] for group in groups],
        )
        for slot in range(group_size)
    ]
    return KVCacheConfig(
        num_blocks=cache.num_gpu_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )
