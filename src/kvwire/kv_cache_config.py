"""How the engine's KV cache memory is laid out, once it has been sized.

The engine builds a :class:`KVCacheConfig` after it has measured how many
blocks fit; connectors receive it as their third constructor argument. More
than one :class:`KVCacheGroupSpec` (full-attention layers beside
sliding-window layers) is what the hybrid KV cache manager serves.
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs import validators

from kvwire.config import DTYPE_SIZES
from kvwire.redaction import shown


def _positive(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {shown(value)}")


def _known_dtype(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in DTYPE_SIZES:
        raise ValueError(f"{attribute.name}: {shown(value)} is not one of {', '.join(DTYPE_SIZES)}")


@attrs.frozen(kw_only=True)
class AttentionSpec:
    """The KV layout of one attention layer: tokens per block and per-token shape."""

    block_size: int = attrs.field(validator=[validators.instance_of(int), _positive])
    num_kv_heads: int = attrs.field(validator=[validators.instance_of(int), _positive])
    head_size: int = attrs.field(validator=[validators.instance_of(int), _positive])
    dtype: str = attrs.field(default="float32", validator=_known_dtype)

    @property
    def dtype_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: keys and values."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size


@attrs.frozen(kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that attends to every previous token."""


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer that attends to the last ``sliding_window`` tokens only."""

    sliding_window: int = attrs.field(validator=[validators.instance_of(int), _positive])


@attrs.frozen(kw_only=True)
class KVCacheTensor:
    """One allocation of ``size_bytes``, shared by the layers named in ``shared_by``."""

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
    layer_name_format: str = "layers.{}.attn",
) -> KVCacheConfig:
    """A single-group cache config: every layer full attention, one tensor per layer."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
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
