"""The engine's configuration, as a connector sees it.

Every class here is a frozen attrs record with validators on its fields: an
invalid value never makes it into a running engine. Use ``attrs.evolve`` to
get an edited copy. Structuring from a dict or a YAML profile (with every bad
field reported by its dotted path) lives in :mod:`kvwire.profile`.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import attrs
from attrs import validators

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")
KV_PRODUCER_ROLES: tuple[str, ...] = ("kv_producer", "kv_both")
KV_CONSUMER_ROLES: tuple[str, ...] = ("kv_consumer", "kv_both")

LoadFailurePolicy = Literal["recompute", "fail"]
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")

# Element sizes of the dtypes a KV cache may hold. Kept as names so that
# configuration never needs torch.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def _engine_id_or_fresh(value: str | None) -> str:
    # A fresh uuid4 per config: two engines never share an id by accident.
    return str(uuid.uuid4()) if value is None else value


def _check_kv_role(instance: KVTransferConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in KV_ROLES:
        raise ValueError(f"Unsupported kv_role: {value}. Supported roles are {KV_ROLES}")
    if instance.kv_connector is not None and value is None:
        raise ValueError(
            f"Please specify kv_role when kv_connector is set, supported roles are {KV_ROLES}"
        )


def _check_load_failure_policy(
    instance: KVTransferConfig, attribute: attrs.Attribute[Any], value: Any
) -> None:
    if value not in LOAD_FAILURE_POLICIES:
        raise ValueError(
            f"Unsupported kv_load_failure_policy: {value!r}. "
            f"Supported policies are {LOAD_FAILURE_POLICIES}"
        )


def _check_port(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not 0 < value < 65536:
        raise ValueError(f"{attribute.name} must be between 1 and 65535, got {value}")


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _check_dtype(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in DTYPE_SIZES:
        raise ValueError(f"{attribute.name}: {value!r} is not one of {', '.join(DTYPE_SIZES)}")


@attrs.frozen(kw_only=True)
class KVTransferConfig:
    """Which connector an engine uses and how it talks to its peers.

    ``engine_id`` is a fresh uuid4 string when left unset, so two configs
    never share one by accident. All attributes are read-only.
    """

    kv_connector: str | None = attrs.field(
        default=None, validator=validators.optional(validators.instance_of(str))
    )
    engine_id: str = attrs.field(
        default=None, converter=_engine_id_or_fresh, validator=validators.instance_of(str)
    )
    kv_buffer_device: str = attrs.field(default="cpu", validator=validators.instance_of(str))
    kv_buffer_size: float = attrs.field(default=1e9, converter=float, validator=_positive)
    kv_role: KVRole | None = attrs.field(default=None, validator=_check_kv_role)
    kv_rank: int | None = attrs.field(
        default=None, validator=validators.optional([validators.instance_of(int), _non_negative])
    )
    kv_parallel_size: int = attrs.field(
        default=1, validator=[validators.instance_of(int), _positive]
    )
    kv_ip: str = attrs.field(default="127.0.0.1", validator=validators.instance_of(str))
    kv_port: int = attrs.field(default=14579, validator=[validators.instance_of(int), _check_port])
    kv_connector_extra_config: dict[str, Any] = attrs.field(
        factory=dict, validator=validators.instance_of(dict)
    )
    kv_connector_module_path: str | None = attrs.field(
        default=None, validator=validators.optional(validators.instance_of(str))
    )
    kv_load_failure_policy: LoadFailurePolicy = attrs.field(
        default="recompute", validator=_check_load_failure_policy
    )

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_ROLES

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_PRODUCER_ROLES

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_CONSUMER_ROLES

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        """The value of ``key`` in ``kv_connector_extra_config``, or ``default``."""
        return self.kv_connector_extra_config.get(key, default)


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Scheduling limits, and whether the hybrid KV cache manager (HMA) is off.

    ``disable_hybrid_kv_cache_manager`` is ``None`` for "decide from the
    connector": HMA stays on when the connector supports it.
    """

    disable_hybrid_kv_cache_manager: bool | None = attrs.field(
        default=None, validator=validators.optional(validators.instance_of(bool))
    )
    max_num_seqs: int = attrs.field(default=16, validator=[validators.instance_of(int), _positive])
    max_num_batched_tokens: int = attrs.field(
        default=512, validator=[validators.instance_of(int), _positive]
    )


@attrs.frozen(kw_only=True)
class CacheConfig:
    """How the paged KV cache is cut: tokens per block and how many blocks."""

    block_size: int = attrs.field(default=16, validator=[validators.instance_of(int), _positive])
    num_gpu_blocks: int = attrs.field(
        default=256, validator=[validators.instance_of(int), _positive]
    )
    enable_prefix_caching: bool = attrs.field(default=True, validator=validators.instance_of(bool))


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The shape of the model whose KV cache is moved.

    ``hidden_size`` must equal ``num_attention_heads * head_size`` and the
    query heads must be a multiple of the KV heads (grouped-query attention).
    """

    num_layers: int = attrs.field(default=2, validator=[validators.instance_of(int), _positive])
    num_attention_heads: int = attrs.field(
        default=4, validator=[validators.instance_of(int), _positive]
    )
    num_kv_heads: int = attrs.field(default=2, validator=[validators.instance_of(int), _positive])
    head_size: int = attrs.field(default=16, validator=[validators.instance_of(int), _positive])
    intermediate_size: int = attrs.field(
        default=128, validator=[validators.instance_of(int), _positive]
    )
    vocab_size: int = attrs.field(default=512, validator=[validators.instance_of(int), _positive])
    max_model_len: int = attrs.field(
        default=2048, validator=[validators.instance_of(int), _positive]
    )
    dtype: str = attrs.field(default="float32", validator=_check_dtype)
    seed: int = attrs.field(default=0, validator=validators.instance_of(int))

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def dtype_size(self) -> int:
        return DTYPE_SIZES[self.dtype]


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """Where this engine process sits among its peers."""

    rank: int = attrs.field(default=0, validator=[validators.instance_of(int), _non_negative])
    world_size: int = attrs.field(default=1, validator=[validators.instance_of(int), _positive])

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank ({self.rank}) must be < world_size ({self.world_size})")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """The whole engine's configuration; what a connector's constructor receives."""

    model_config: ModelConfig = attrs.field(factory=ModelConfig)
    cache_config: CacheConfig = attrs.field(factory=CacheConfig)
    parallel_config: ParallelConfig = attrs.field(factory=ParallelConfig)
    scheduler_config: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    kv_transfer_config: KVTransferConfig | None = attrs.field(default=None)
