"""The engine's configuration, as a connector sees it.

Every class here is a frozen attrs record with validators on its fields: an
invalid value never makes it into a running engine. Counts have upper bounds
no real model reaches, and an `kvwire.EngineConfig` whose KV cache, weights
and batch logits could not fit in this machine's memory is refused when it is built
(`kvwire.config.memory_limits`), so an absurd profile fails `kvwire check`
rather than the engine. Errors and reprs show values through
`kvwire.common.redaction`: bounded, and never a secret of
`kv_connector_extra_config`. Use `attrs.evolve` to get an edited copy.
Structuring from a dict or a YAML profile (with every bad field reported by
its dotted path) lives in `kvwire.config.profile`.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
from attrs import validators

from kvwire.common.redaction import kind_of, shown, shown_key
from kvwire.config.dtypes import DTYPES, check_dtype
from kvwire.config.memory_limits import describe_bytes, memory_shortfall
from kvwire.identity.model import check_explicit_identity

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")
KV_PRODUCER_ROLES: tuple[str, ...] = ("kv_producer", "kv_both")
KV_CONSUMER_ROLES: tuple[str, ...] = ("kv_consumer", "kv_both")

# The paged cache layouts a connector can move blocks of, one tensor per layer:
# "kvwire" is kvwire's engine's [2, num_blocks, block_size, num_kv_heads, head_size];
# "vllm_cpu" is vLLM's CPU backend's [num_blocks, num_kv_heads, block_size,
# 2 * head_size], whose packing inside a block depends on the CPU's instruction
# path, so its blocks are moved as whole byte ranges and shared only with an
# engine of the same layout.
KV_CACHE_LAYOUTS: tuple[str, ...] = ("kvwire", "vllm_cpu")

LoadFailurePolicy = Literal["recompute", "fail"]
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")


# Upper bounds on counts, far above any real model (the deepest have about
# 130 layers, the widest vocabularies about 260k tokens) and far below what
# would make one allocation absurd: a typo of a few extra digits is caught
# here, by name, instead of as a MemoryError deep in the engine.
COUNT_LIMITS: dict[str, int] = {
    "num_layers": 1024,
    "num_attention_heads": 4096,
    "num_kv_heads": 4096,
    "head_size": 4096,
    "intermediate_size": 2**20,
    "vocab_size": 2**24,
    "max_model_len": 2**24,
    "block_size": 2**16,
    "num_gpu_blocks": 2**32,
    "max_num_seqs": 2**20,
    "max_num_batched_tokens": 2**24,
    "world_size": 2**16,
    "tensor_parallel_size": 2**16,
    "pipeline_parallel_size": 2**16,
    "rank": 2**16,
    "kv_parallel_size": 2**16,
    "kv_rank": 2**16,
}
# Of a name or path field (a connector, a module path, an engine id): PATH_MAX.
LONGEST_NAME = 4096
# torch.Generator.manual_seed accepts this range.
SEED_RANGE = (-(2**63), 2**64 - 1)


def _engine_id_or_fresh(value: str | None) -> str:
    # A fresh uuid4 per config: two engines never share an id by accident.
    return str(uuid.uuid4()) if value is None else value


def _buffer_size_as_float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        # float() of a 400-digit integer; OverflowError would name nothing.
        raise ValueError(f"kv_buffer_size is too large, got {shown(value)}") from None
    except (TypeError, ValueError) as error:
        # float()'s own text names no field, and quotes a string whole, however long.
        raise type(error)(f"kv_buffer_size must be a number, got {shown(value)}") from None


def _shown_plain(value: object) -> str:
    # As str() would show it (vLLM's texts), but bounded.
    return value if isinstance(value, str) and len(value) <= 80 else shown(value)


def _check_kv_role(instance: KVTransferConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in KV_ROLES:
        raise ValueError(
            f"Unsupported kv_role: {_shown_plain(value)}. Supported roles are {KV_ROLES}"
        )
    if instance.kv_connector is not None and value is None:
        raise ValueError(
            f"Please specify kv_role when kv_connector is set, supported roles are {KV_ROLES}"
        )


def _check_load_failure_policy(
    instance: KVTransferConfig, attribute: attrs.Attribute[Any], value: Any
) -> None:
    if value not in LOAD_FAILURE_POLICIES:
        raise ValueError(
            f"Unsupported kv_load_failure_policy: {shown(value)}. "
            f"Supported policies are {LOAD_FAILURE_POLICIES}"
        )


def _check_port(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not 0 < value < 65536:
        raise ValueError(f"{attribute.name} must be between 1 and 65535, got {shown(value)}")


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {shown(value)}")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {shown(value)}")


def _finite(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value}")


def _at_most_count_limit(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    limit = COUNT_LIMITS[attribute.name]
    if value > limit:
        raise ValueError(
            f"{attribute.name} must be <= {limit} (far more than any real model uses), "
            f"got {shown(value)}"
        )


def _check_seed(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    low, high = SEED_RANGE
    if not low <= value <= high:
        raise ValueError(f"{attribute.name} must be between {low} and {high}, got {shown(value)}")


def _of_kind(kind: type, description: str) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    """Like `validators.instance_of`, but the error shows the value's type, never the value.

    attrs' own error carries the value and the whole attribute in its
    arguments: unbounded, and a secret typed into the wrong field.
    """

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"{attribute.name} must be {description}, got {kind_of(value)}")

    return check


def _text(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A name or path: a string without NUL bytes, of at most `LONGEST_NAME` characters.

    Names and paths reach open() and the import machinery, and errors quote
    them (an unknown connector's name): neither takes a NUL or a megabyte.
    """
    _of_kind(str, "a string")(instance, attribute, value)
    if "\x00" in value:
        raise ValueError(f"{attribute.name} contains a NUL byte (\\x00), which no name may hold")
    if len(value) > LONGEST_NAME:
        raise ValueError(
            f"{attribute.name} must be at most {LONGEST_NAME} characters, got {len(value)}"
        )


def _count(*more: Callable[[object, attrs.Attribute[Any], Any], None]) -> list[Any]:
    """The validators of a positive count with an upper bound (`COUNT_LIMITS`)."""
    return [_of_kind(int, "an integer"), _positive, _at_most_count_limit, *more]


def _check_extra_config(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    _of_kind(dict, "a mapping")(instance, attribute, value)
    for path in _paths_with_nul(value, attribute.name):
        raise ValueError(f"{path} contains a NUL byte (\\x00), which no name or path may hold")


def _paths_with_nul(value: Any, path: str) -> Iterator[str]:
    """Dotted paths of the strings (keys and values) in `value` that hold a NUL byte.

    Each list or mapping is visited once, however often it is referred to:
    a structure shared many times over (or containing itself) costs what
    its distinct parts cost, not what it expands to.
    """
    seen: set[int] = set()
    pending: list[tuple[Any, str]] = [(value, path)]
    while pending:
        item, item_path = pending.pop()
        if isinstance(item, str):
            if "\x00" in item:
                yield item_path
            continue
        if not isinstance(item, Mapping | list | tuple) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Mapping):
            for key, child in item.items():
                child_path = f"{item_path}.{shown_key(key)}"
                if isinstance(key, str) and "\x00" in key:
                    yield child_path
                pending.append((child, child_path))
        else:
            pending.extend((child, f"{item_path}[{index}]") for index, child in enumerate(item))


def _extra_config_repr(value: dict[str, Any]) -> str:
    # Secrets blanked by key name and in URLs; long enough to read, bounded.
    return shown(value, limit=400)


def _bounded_repr(value: object) -> str:
    return shown(value, limit=200)


@attrs.frozen(kw_only=True)
class KVTransferConfig:
    """Which connector an engine uses and how it talks to its peers.

    `engine_id` is a fresh uuid4 string when left unset, so two configs
    never share one by accident. All attributes are read-only.
    """

    kv_connector: str | None = attrs.field(
        default=None, validator=validators.optional(_text), repr=_bounded_repr
    )
    engine_id: str = attrs.field(
        default=None, converter=_engine_id_or_fresh, validator=_text, repr=_bounded_repr
    )
    kv_buffer_device: str = attrs.field(default="cpu", validator=_text, repr=_bounded_repr)
    kv_buffer_size: float = attrs.field(
        default=1e9, converter=_buffer_size_as_float, validator=[_positive, _finite]
    )
    kv_role: KVRole | None = attrs.field(default=None, validator=_check_kv_role, repr=_bounded_repr)
    kv_rank: int | None = attrs.field(
        default=None,
        validator=validators.optional(
            [_of_kind(int, "an integer"), _non_negative, _at_most_count_limit]
        ),
    )
    kv_parallel_size: int = attrs.field(default=1, validator=_count())
    kv_ip: str = attrs.field(default="127.0.0.1", validator=_text, repr=_bounded_repr)
    kv_port: int = attrs.field(default=14579, validator=[_of_kind(int, "an integer"), _check_port])
    kv_connector_extra_config: dict[str, Any] = attrs.field(
        factory=dict, validator=_check_extra_config, repr=_extra_config_repr
    )
    kv_connector_module_path: str | None = attrs.field(
        default=None, validator=validators.optional(_text), repr=_bounded_repr
    )
    kv_load_failure_policy: LoadFailurePolicy = attrs.field(
        default="recompute", validator=_check_load_failure_policy, repr=_bounded_repr
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
        """The value of `key` in `kv_connector_extra_config`, or `default`."""
        return self.kv_connector_extra_config.get(key, default)


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Scheduling limits, and whether the hybrid KV cache manager (HMA) is off.

    `disable_hybrid_kv_cache_manager` is `None` for "decide from the
    connector": HMA stays on when the connector supports it.
    """

    disable_hybrid_kv_cache_manager: bool | None = attrs.field(
        default=None, validator=validators.optional(_of_kind(bool, "true or false"))
    )
    max_num_seqs: int = attrs.field(default=16, validator=_count())
    max_num_batched_tokens: int = attrs.field(default=512, validator=_count())


@attrs.frozen(kw_only=True)
class CacheConfig:
    """How the paged KV cache is cut: tokens per block and how many blocks."""

    block_size: int = attrs.field(default=16, validator=_count())
    num_gpu_blocks: int = attrs.field(default=256, validator=_count())
    enable_prefix_caching: bool = attrs.field(
        default=True, validator=_of_kind(bool, "true or false")
    )
    # How the engine lays out one layer's paged cache (see KV_CACHE_LAYOUTS); it
    # is part of every stored block's layout fingerprint.
    kv_cache_layout: str = attrs.field(default="kvwire", validator=validators.in_(KV_CACHE_LAYOUTS))


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES: tuple[str, ...] = (FULL_ATTENTION, SLIDING_ATTENTION)


def _as_tuple(value: Any) -> Any:
    # A list (from Python or YAML) becomes the tuple a frozen record keeps;
    # anything else is left for the validator to name.
    return tuple(value) if isinstance(value, list) else value


def _check_layer_types(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple):
        raise TypeError(
            f"{attribute.name} must be a list of {', '.join(LAYER_TYPES)}, got {kind_of(value)}"
        )
    for index, layer_type in enumerate(value):
        if layer_type not in LAYER_TYPES:
            raise ValueError(
                f"{attribute.name}: entry {index} is {shown(layer_type)}, not one of "
                f"{', '.join(LAYER_TYPES)}"
            )


def _check_identity(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_explicit_identity(value)


def _window_limit(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    limit = COUNT_LIMITS["max_model_len"]
    if value > limit:
        raise ValueError(f"{attribute.name} must be <= {limit}, got {shown(value)}")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The shape of the model whose KV cache is moved.

    `hidden_size` must equal `num_attention_heads * head_size` and the
    query heads must be a multiple of the KV heads (grouped-query attention).
    A hybrid model names each layer's kind in `layer_types` (one entry per
    layer) and the window of its sliding-window layers in `sliding_window`.
    """

    num_layers: int = attrs.field(default=2, validator=_count())
    num_attention_heads: int = attrs.field(default=4, validator=_count())
    num_kv_heads: int = attrs.field(default=2, validator=_count())
    head_size: int = attrs.field(default=16, validator=_count())
    intermediate_size: int = attrs.field(default=128, validator=_count())
    vocab_size: int = attrs.field(default=512, validator=_count())
    max_model_len: int = attrs.field(default=2048, validator=_count())
    dtype: str = attrs.field(default="float32", validator=check_dtype, repr=_bounded_repr)
    seed: int = attrs.field(default=0, validator=[_of_kind(int, "an integer"), _check_seed])
    # Which weights produce the KV, named by the operator (see
    # kvwire.identity.model); empty: derived from the weights. Part of the
    # layout fingerprint (weights_identity): two models of one shape never
    # load each other's blocks.
    identity: str = attrs.field(default="", validator=_check_identity, repr=_bounded_repr)
    # Per layer, as Hugging Face's Gemma 2/3 configs name them: "full_attention"
    # or "sliding_attention" (attends to the last `sliding_window` tokens).
    # Empty: every layer full attention.
    layer_types: tuple[str, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_check_layer_types, repr=_bounded_repr
    )
    sliding_window: int | None = attrs.field(
        default=None,
        validator=validators.optional([_of_kind(int, "an integer"), _positive, _window_limit]),
    )

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers is "
                f"{self.num_layers}; give one of {', '.join(LAYER_TYPES)} per layer, "
                "or leave layer_types empty for all full attention"
            )
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ValueError(
                "layer_types has sliding_attention layers but sliding_window is not set; "
                "set sliding_window to the number of tokens (>= 1) such a layer attends to"
            )
        if self.sliding_window is not None and SLIDING_ATTENTION not in self.layer_types:
            # A window no layer uses is a config mistake (layer_types left
            # out, most likely): every layer would silently attend to all.
            raise ValueError(
                f"sliding_window is {self.sliding_window} but layer_types names no "
                f"{SLIDING_ATTENTION} layer; list each layer's kind in layer_types "
                f"(one of {', '.join(LAYER_TYPES)} per layer), or leave sliding_window "
                "unset for a model of full-attention layers only"
            )

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers attend only to a sliding window (what HMA serves)."""
        return SLIDING_ATTENTION in self.layer_types

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def weights_description(self) -> str:
        """What decides kvwire's engine's weights: its seed, shape and dtype (it draws them)."""
        description = (
            f"kvwire-model;seed={self.seed};layers={self.num_layers};"
            f"heads={self.num_attention_heads};kv_heads={self.num_kv_heads};"
            f"head_size={self.head_size};intermediate={self.intermediate_size};"
            f"vocab={self.vocab_size};dtype={self.dtype}"
        )
        if self.is_hybrid:
            # Windowed layers compute other keys and values than full ones. Only
            # hybrid models say so, so every other model keeps its description.
            description += (
                f";layer_types={','.join(self.layer_types)};sliding_window={self.sliding_window}"
            )
        return description

    @property
    def weights_identity(self) -> str:
        """The identity that names this model's stored blocks: `identity` when set, else
        that of kvwire's engine's weights, drawn from `weights_description`."""
        return self.identity or f"kvwire-engine:{self.weights_description}"

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def dtype_size(self) -> int:
        return DTYPES[self.dtype].size

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's keys (or values) in one layer."""
        return self.num_kv_heads * self.head_size * self.dtype_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights at `dtype`: embedding, LM head and each layer's projections."""
        hidden = self.hidden_size
        kv_width = self.num_kv_heads * self.head_size
        per_layer = (
            2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * self.intermediate_size
        )
        parameters = 2 * self.vocab_size * hidden + self.num_layers * per_layer
        return parameters * self.dtype_size


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """Where this engine process sits among its peers: its rank, and how the model is split.

    `tensor_parallel_size` ranks split each layer's KV heads (rank `r`
    holds heads `[r * H / tp, (r + 1) * H / tp)` of the model's `H`);
    `pipeline_parallel_size` stages split the layers. Ranks count tensor
    ranks first: rank `r` is tensor rank `r % tp` of pipeline stage
    `r // tp`, as vLLM numbers its workers. `world_size` defaults to
    `tp * pp`. `pipeline_layers`: each stage's first layer, then the
    model's layer count (vLLM's split); empty when not split in stages.
    """

    tensor_parallel_size: int = attrs.field(default=1, validator=_count())
    pipeline_parallel_size: int = attrs.field(default=1, validator=_count())
    rank: int = attrs.field(
        default=0, validator=[_of_kind(int, "an integer"), _non_negative, _at_most_count_limit]
    )
    world_size: int = attrs.field(validator=_count())
    pipeline_layers: tuple[int, ...] = attrs.field(
        default=(),
        validator=validators.deep_iterable(_of_kind(int, "an integer")),
    )

    @world_size.default
    def _split_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank ({self.rank}) must be < world_size ({self.world_size})")
        stages = self.pipeline_layers
        if stages and (
            len(stages) != self.pipeline_parallel_size + 1
            or stages[0] != 0
            or any(a >= b for a, b in itertools.pairwise(stages))
        ):
            raise ValueError(
                f"pipeline_layers: {list(stages)[:8]} are not each stage's first layer then the "
                f"model's layer count: expected {self.pipeline_parallel_size + 1} increasing "
                "numbers from 0"
            )
        split = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.world_size % split:
            raise ValueError(
                f"world_size ({self.world_size}) must be a multiple of tensor_parallel_size "
                f"({self.tensor_parallel_size}) x pipeline_parallel_size "
                f"({self.pipeline_parallel_size})"
            )

    @property
    def tensor_rank(self) -> int:
        """Which share of the KV heads this rank holds (0 .. tensor_parallel_size - 1)."""
        return self.rank % self.tensor_parallel_size

    @property
    def pipeline_rank(self) -> int:
        """Which stage of the layers this rank holds (0 .. pipeline_parallel_size - 1)."""
        return (self.rank // self.tensor_parallel_size) % self.pipeline_parallel_size

    def stage_layers(self, stage: int) -> range | None:
        """The model's layers stage `stage` holds; None when `pipeline_layers` is unset."""
        if not self.pipeline_layers:
            return None
        return range(self.pipeline_layers[stage], self.pipeline_layers[stage + 1])

    @property
    def is_split(self) -> bool:
        """Whether the model's KV is split over several ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size > 1


@attrs.frozen(kw_only=True)
class EngineConfig:
    """The whole engine's configuration; what a connector's constructor receives."""

    model_config: ModelConfig = attrs.field(factory=ModelConfig)
    cache_config: CacheConfig = attrs.field(factory=CacheConfig)
    parallel_config: ParallelConfig = attrs.field(factory=ParallelConfig)
    scheduler_config: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    kv_transfer_config: KVTransferConfig | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        # The engine allocates its KV cache and the model's weights up front:
        # refuse, by name, what this machine could never hold.
        kv_cache = self.kv_cache_bytes
        weights = self.model_config.weight_bytes
        logits = self.logits_bytes
        shortfall = memory_shortfall(kv_cache + weights + logits)
        if shortfall:
            model, cache = self.model_config, self.cache_config
            tokens = self.scheduler_config.max_num_batched_tokens
            raise ValueError(
                "model_config, cache_config, scheduler_config: the engine needs at least "
                f"{describe_bytes(kv_cache + weights + logits)}, {shortfall}. The KV cache "
                f"(2 x num_layers {model.num_layers} x num_gpu_blocks {cache.num_gpu_blocks} x "
                f"block_size {cache.block_size} x num_kv_heads {model.num_kv_heads} x head_size "
                f"{model.head_size} x {model.dtype_size} bytes of {model.dtype}): "
                f"{describe_bytes(kv_cache)}; the weights: {describe_bytes(weights)}; a batch's "
                f"logits (max_num_batched_tokens {tokens} x vocab_size {model.vocab_size} x "
                f"{model.dtype_size} bytes): {describe_bytes(logits)}"
            )

    @property
    def logits_bytes(self) -> int:
        """Bytes of one batch's logits at the model's dtype: the widest per-token buffer."""
        tokens = self.scheduler_config.max_num_batched_tokens
        return tokens * self.model_config.vocab_size * self.model_config.dtype_size

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the engine's KV cache: every layer's blocks, keys and values."""
        block_bytes = 2 * self.cache_config.block_size * self.model_config.kv_bytes_per_token
        return self.model_config.num_layers * self.cache_config.num_gpu_blocks * block_bytes
