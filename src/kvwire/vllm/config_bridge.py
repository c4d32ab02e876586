"""kvwire's configuration from vLLM's: the profile, the `EngineConfig`, the `KVCacheConfig`.

vLLM's `kv_connector_extra_config` names the kvwire profile, as a path
(`"kvwire_profile"`) or inline (`"kvwire"`, a profile mapping), plus
optionally `"kvwire_container_hook"`. Any other key is an error naming it.
The profile says which kvwire connector to wrap and its settings; what vLLM
already knows (the model's shape and identity, the KV dtype, the block size,
the kv_role, engine_id and load-failure policy) comes from vLLM. The
profile's `model_config`, `cache_config` and `parallel_config` describe
kvwire's own engine (the shipped profiles have them) and are replaced; a
value the profile sets that vLLM's replaces is logged
(`kvwire.vllm.overrides`). What can be checked before vLLM has built
its KV cache (`config_before_kv_cache`) is checked before vLLM loads
the model (`kvwire.vllm.startup_check`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import attrs

from kvwire.common.plugin_calls import contained_exits, plugin_message
from kvwire.common.redaction import shown
from kvwire.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvwire.config.dtypes import DTYPE_NAMES, DTYPES
from kvwire.config.kv_cache import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from kvwire.config.profile import load_profile
from kvwire.exceptions import VLLMConfigError
from kvwire.identity.model import (
    LONGEST_IDENTITY,
    ModelIdentityError,
    UnreadableWeightsError,
    default_hub_caches,
    model_identity,
)
from kvwire.vllm.weight_stamps import WEIGHT_STAMPS_KEY, recorded_weight_stamps

if TYPE_CHECKING:
    from dependency_injector import containers

logger = logging.getLogger(__name__)

PROFILE_PATH_KEY = "kvwire_profile"
INLINE_PROFILE_KEY = "kvwire"
CONTAINER_HOOK_KEY = "kvwire_container_hook"
EXTRA_CONFIG_KEYS = (PROFILE_PATH_KEY, INLINE_PROFILE_KEY, CONTAINER_HOOK_KEY)

_PROFILE_FORMS: dict[str, tuple[type, str]] = {
    PROFILE_PATH_KEY: (str, "a profile's name or path (str)"),
    INLINE_PROFILE_KEY: (Mapping, "a profile mapping"),
}
"""What each key that gives the profile holds: its type, and that type as an error says it."""

_SHOWN_KEYS = 5

ContainerHook = Callable[["containers.Container"], None]


def read_kvwire_profile(extra_config: Mapping[str, Any]) -> EngineConfig:
    """The kvwire profile vLLM's `kv_connector_extra_config` names, validated."""
    # Shown bounded and sorted as text: keys may be long, or not all str.
    # The weights' stamps are kvwire's own, written by its config hook (weight_stamps).
    unknown = sorted(
        shown(key)
        for key in extra_config
        if key not in EXTRA_CONFIG_KEYS and key != WEIGHT_STAMPS_KEY
    )
    if unknown:
        more = f" and {len(unknown) - _SHOWN_KEYS} more" if len(unknown) > _SHOWN_KEYS else ""
        raise VLLMConfigError(
            "kv_transfer_config.kv_connector_extra_config: unknown key(s) "
            f"{', '.join(unknown[:_SHOWN_KEYS])}{more}; KVWireConnector accepts "
            f"{', '.join(map(repr, EXTRA_CONFIG_KEYS))}"
        )
    has_path = PROFILE_PATH_KEY in extra_config
    has_inline = INLINE_PROFILE_KEY in extra_config
    if has_path == has_inline:
        raise VLLMConfigError(
            "kv_transfer_config.kv_connector_extra_config: give the kvwire profile either as "
            f"{PROFILE_PATH_KEY!r} (a shipped profile's name or a YAML path) or as "
            f"{INLINE_PROFILE_KEY!r} (a mapping), "
            f"{'not both' if has_path else 'got neither'}"
        )
    key = PROFILE_PATH_KEY if has_path else INLINE_PROFILE_KEY
    expected_type, expected = _PROFILE_FORMS[key]
    given = type(extra_config[key])
    if not issubclass(given, expected_type):
        raise VLLMConfigError(
            f"kv_transfer_config.kv_connector_extra_config.{key}: expected "
            f"{expected}, got {given.__name__}"
        )
    return load_profile(extra_config[key])


def container_hook(extra_config: Mapping[str, Any]) -> ContainerHook | None:
    """The `"module:function"` named by `kvwire_container_hook`, imported; None if unset.

    It is called with the container before the connector is built, so a
    deployment (or a test) overrides providers there, in whichever process
    vLLM builds the connector.
    """
    spec = extra_config.get(CONTAINER_HOOK_KEY)
    if spec is None:
        return None
    if not _is_hook_spec(spec):
        raise VLLMConfigError(
            f"{_HOOK_FIELD}: expected 'package.module:function' (dotted Python names), "
            f"got {shown(spec)}"
        )
    module_name, function_name = spec.split(":")
    try:
        with contained_exits():
            module = importlib.import_module(module_name)
    # Whatever a module raises at import (a RuntimeError of its own, a
    # SyntaxError, a sys.exit()): the profile's error, its message redacted,
    # nothing chained.
    except Exception as error:
        raise VLLMConfigError(
            f"{_HOOK_FIELD}: cannot import {shown(module_name)}: {plugin_message(error)}"
        ) from None
    hook = getattr(module, function_name, None)
    if not callable(hook):
        raise VLLMConfigError(
            f"{_HOOK_FIELD}: {shown(module_name)} has no function {shown(function_name)}"
        )
    return hook  # type: ignore[no-any-return]


def run_container_hook(hook: ContainerHook, container: containers.Container) -> None:
    """Call `hook` on `container`; what it raises becomes an error naming the hook."""
    try:
        with contained_exits():
            hook(container)
    except Exception as error:
        name = f"{getattr(hook, '__module__', '?')}:{getattr(hook, '__qualname__', '?')}"
        raise VLLMConfigError(
            f"{_HOOK_FIELD}: the container hook {name} raised {plugin_message(error)}"
        ) from None


_HOOK_FIELD = f"kv_transfer_config.kv_connector_extra_config.{CONTAINER_HOOK_KEY}"


def _is_hook_spec(spec: object) -> TypeGuard[str]:
    # Checked before importing: importlib raises ValueError/TypeError, not
    # ImportError, for an empty or relative module name.
    if not isinstance(spec, str) or spec.count(":") != 1:
        return False
    module_name, function_name = spec.split(":")
    return function_name.isidentifier() and all(
        part.isidentifier() for part in module_name.split(".")
    )


def kv_dtype_name(dtype: Any, field: str) -> str:
    """kvwire's name of a torch dtype (`torch.float8_e4m3fn` -> `"float8_e4m3fn"`).

    `field` names where vLLM's configuration holds it, for the error.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise VLLMConfigError(
            f"vLLM's {field} is {shown(name)}, a KV cache dtype kvwire does not move; "
            f"accepted: {', '.join(DTYPE_NAMES)}"
        )
    return name


def engine_config_from_vllm(
    vllm_config: Any, profile: EngineConfig, kv_cache_config: KVCacheConfig
) -> EngineConfig:
    """`profile` with the engine's facts taken from vLLM's `VllmConfig`.

    `kv_connector` and its extra config stay the profile's: they name the
    kvwire connector to wrap. `kv_cache_config` is the cache vLLM built
    (`kv_cache_config_from_vllm`): whether the wrapped connector must
    serve the hybrid KV cache manager depends on it
    (`wrapped_hma_setting`). The model's shape is one rank's: its
    share of the KV heads (tensor parallelism) and of the layers (pipeline
    parallelism); the parallel layout is `parallel_config_from_vllm`'s,
    rank 0's (a worker's connector overrides it with its own rank). Raises
    `VLLMConfigError` for what kvwire cannot serve inside vLLM. The
    scheduler side logs the profile's values this replaces
    (`kvwire.vllm.overrides.log_overridden_values`).
    """
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    kvwire_parallel = parallel_config_from_vllm(vllm_config)
    if kvwire_parallel.pipeline_parallel_size > 1 and has_hybrid_groups(kv_cache_config):
        raise VLLMConfigError(
            "KVWireConnector: pipeline_parallel_size "
            f"{kvwire_parallel.pipeline_parallel_size} with the hybrid KV cache manager's "
            "several KV cache groups is not served; start vLLM with "
            "--disable-hybrid-kv-cache-manager, or without pipeline parallelism"
        )
    transfer = _transfer_config_from_vllm(vllm_config.kv_transfer_config, profile)
    hf_text_config = model_config.hf_text_config
    model = ModelConfig(
        num_layers=model_config.get_num_layers(parallel),
        num_attention_heads=model_config.get_num_attention_heads(parallel),
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_size=model_config.get_head_size(),
        intermediate_size=int(getattr(hf_text_config, "intermediate_size", 1) or 1),
        vocab_size=model_config.get_vocab_size(),
        max_model_len=model_config.max_model_len,
        dtype=_cache_dtype(vllm_config),
        seed=int(model_config.seed or 0),
        identity=vllm_model_identity(vllm_config, profile.model_config.identity),
    )
    cache = CacheConfig(
        block_size=vllm_config.cache_config.block_size,
        num_gpu_blocks=max(1, int(vllm_config.cache_config.num_gpu_blocks or 1)),
        enable_prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        kv_cache_layout="vllm_cpu",
    )
    scheduler = vllm_config.scheduler_config
    return attrs.evolve(
        profile,
        model_config=model,
        cache_config=cache,
        parallel_config=kvwire_parallel,
        scheduler_config=SchedulerConfig(
            disable_hybrid_kv_cache_manager=wrapped_hma_setting(
                scheduler.disable_hybrid_kv_cache_manager, kv_cache_config
            ),
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
        ),
        kv_transfer_config=transfer,
    )


def parallel_config_from_vllm(vllm_config: Any, rank: int = 0) -> ParallelConfig:
    """The tensor and pipeline parallel sizes of vLLM's `parallel_config`, at `rank`.

    Read from the config alone: the scheduler side is built where no process
    group exists. A tensor-parallel size above the model's KV heads (vLLM
    then gives several ranks the same head) is refused: each rank's entries
    would not be a share of the heads. Each pipeline stage's layers are
    vLLM's split (`get_pp_indices`).
    """
    parallel = vllm_config.parallel_config
    tensor_size = int(parallel.tensor_parallel_size)
    pipeline_size = int(parallel.pipeline_parallel_size)
    total_kv_heads = int(vllm_config.model_config.get_total_num_kv_heads())
    if tensor_size > 1 and total_kv_heads % tensor_size:
        raise VLLMConfigError(
            f"KVWireConnector: tensor_parallel_size {tensor_size} does not divide the model's "
            f"{total_kv_heads} KV heads (vLLM would replicate heads over ranks); kvwire serves "
            f"a tensor_parallel_size that divides {total_kv_heads}"
        )
    stages: tuple[int, ...] = ()
    if pipeline_size > 1:
        from vllm.distributed.utils import get_pp_indices

        total_layers = int(vllm_config.model_config.get_total_num_hidden_layers())
        bounds = [
            get_pp_indices(total_layers, stage, pipeline_size) for stage in range(pipeline_size)
        ]
        stages = (*(start for start, _ in bounds), total_layers)
    return ParallelConfig(
        tensor_parallel_size=tensor_size,
        pipeline_parallel_size=pipeline_size,
        rank=rank,
        pipeline_layers=stages,
    )


def worker_parallel_config(vllm_config: Any) -> ParallelConfig:
    """The parallel layout of this vLLM worker: its tensor and pipeline rank, from vLLM's groups.

    vLLM builds a worker's connector once its process groups exist; a
    connector built without them (by hand, in a test) is the rank vLLM's
    `parallel_config.rank` says, as a worker sets it.
    """
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        return parallel_config_from_vllm(vllm_config, int(vllm_config.parallel_config.rank or 0))
    tensor_size = int(vllm_config.parallel_config.tensor_parallel_size)
    rank = get_pp_group().rank_in_group * tensor_size + get_tensor_model_parallel_rank()
    return parallel_config_from_vllm(vllm_config, rank)


def has_hybrid_groups(kv_cache_config: KVCacheConfig) -> bool:
    """Whether the cache has more than the one full-attention group HMA off gives.

    A connector without HMA can serve only that one: it would index every
    layer with one block table, and save or load a sliding-window group's
    null blocks as if they held KV.
    """
    groups = kv_cache_config.kv_cache_groups
    return len(groups) > 1 or any(
        not isinstance(group.kv_cache_spec, FullAttentionSpec) for group in groups
    )


def wrapped_hma_setting(
    vllm_disable_hma: bool | None, kv_cache_config: KVCacheConfig
) -> bool | None:
    """The `disable_hybrid_kv_cache_manager` the wrapped kvwire connector is built with.

    vLLM's own, except where HMA is on but the cache vLLM built is the one
    full-attention group it would build with HMA off (a model without
    sliding-window layers): HMA then changes nothing, so it is left unset and
    kvwire's gate decides from the wrapped connector, as in kvwire's engine.
    `KVWireConnector` declares `SupportsHMA` whatever it wraps (vLLM
    asks its class before the profile is read), so vLLM keeps HMA on unless
    told otherwise, for every model; False here means a hybrid cache the
    wrapped connector must serve.
    """
    if vllm_disable_hma is False and not has_hybrid_groups(kv_cache_config):
        return None
    return vllm_disable_hma


# Load formats whose weights are the files at `model` as they are on disk
# (vLLM's default loader, its pre-sharded and streaming loaders of the same
# safetensors): the identity digested from those files is theirs. Any other
# format (dummy's random values, tensorizer's or ipc_cache's or
# modelexpress's weights from elsewhere, a plug-in loader) computes with
# weights kvwire has not read.
ON_DISK_LOAD_FORMATS = frozenset(
    {
        "auto",
        "hf",
        "safetensors",
        "pt",
        "npcache",
        "fastsafetensors",
        "instanttensor",
        "mistral",
        "sharded_state",
        "runai_streamer",
        "runai_streamer_sharded",
    }
)
_LOAD_FORMAT_FIELD = "load_config.load_format"


def vllm_model_identity(vllm_config: Any, explicit: str = "") -> str:
    """Which weights produce the KV, and how vLLM computes with them.

    The weights' identity (`kvwire.identity.model.model_identity`:
    `explicit`, the profile's `model_config.identity`, when set; else the
    hub commit or a digest of the files vLLM's `model` names, never the
    name itself), then what vLLM changes in the computation: the model's
    dtype, its quantization, any `hf_overrides` or `quantization_config`,
    a `hf_config_path` and a `model_impl` other than `auto`, and
    whether LongRoPE's long factors apply to every position (they do once
    `max_model_len` passes the model's original context).

    Weights kvwire cannot be sure of get an identity of this engine alone
    (`engine_only_identity`), with a warning: a load format that does
    not read the files as they are (`dummy`'s random values included)
    unless `explicit` names them, files that cannot be read, and files
    that are not those vLLM was configured with (`kvwire.vllm.weight_stamps`:
    replaced or changed since, so vLLM may have loaded other bytes).
    """
    model_config = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    download_dir = getattr(load_config, "download_dir", None)
    load_format = str(getattr(load_config, "load_format", "auto") or "auto").lower()
    hub_caches = [*([download_dir] if download_dir else []), *default_hub_caches()]
    if load_format not in ON_DISK_LOAD_FORMATS and not explicit:
        logger.warning(
            "KVWireConnector: vLLM's %s is %s, which does not compute with the weights as "
            "they are at the model's path, so this engine shares KV with no other; set "
            "model_config.identity in the kvwire profile to a name for the weights it loads "
            "to share them (load formats read from the files as they are: %s)",
            _LOAD_FORMAT_FIELD,
            shown(load_format),
            ", ".join(sorted(ON_DISK_LOAD_FORMATS)),
        )
        weights = engine_only_identity(vllm_config, f"load_format={load_format}")
    else:
        try:
            weights = model_identity(
                str(model_config.model),
                model_config.revision,
                explicit=explicit,
                hub_caches=hub_caches,
                stamps=recorded_weight_stamps(vllm_config),
            )
        except UnreadableWeightsError as error:
            logger.warning("KVWireConnector: %s; this engine shares KV with no other", error)
            weights = engine_only_identity(vllm_config, "unreadable-weights")
        except ModelIdentityError as error:
            raise VLLMConfigError(str(error)) from None
        if load_format == "dummy":
            # The operator's name for random weights: never the real weights' blocks.
            weights += ";load_format=dummy"
    computed = f"dtype={model_config.dtype};quantization={model_config.quantization}"
    for name in ("hf_overrides", "quantization_config"):
        value = getattr(model_config, name, None)
        if value and callable(value):
            # A function of the config: its name is all kvwire can tell of it.
            computed += f";{name}={getattr(value, '__qualname__', type(value).__name__)}"
        elif value:
            described = json.dumps(value, sort_keys=True, default=repr).encode()
            computed += f";{name}={hashlib.sha256(described).hexdigest()[:32]}"
    model_impl = str(getattr(model_config, "model_impl", "auto") or "auto")
    if model_impl != "auto":
        computed += f";model_impl={model_impl}"
    if _uses_long_rope_factors(model_config):
        # LongRoPE (Phi-3): vLLM rotates keys with the long factors at every
        # position once max_model_len passes the original context, so the
        # same model computes other keys at other max_model_len.
        computed += ";long_rope_factors"
    hf_config_path = getattr(model_config, "hf_config_path", None)
    if hf_config_path and str(hf_config_path) != str(model_config.model):
        computed += f";hf_config={_config_identity(str(hf_config_path), hub_caches)}"
    identity = f"{weights};{computed}"
    if len(identity) > LONGEST_IDENTITY:
        # The identity names entries in a bounded field: a long one is named by its digest.
        identity = f"digest:{hashlib.sha256(identity.encode()).hexdigest()}"
    return identity


def _uses_long_rope_factors(model_config: Any) -> bool:
    """Whether vLLM's LongRoPE uses its long factors for every position of this engine."""
    parameters = getattr(getattr(model_config, "hf_text_config", None), "rope_parameters", None)
    if not isinstance(parameters, Mapping):
        return False
    # Per attention type ({"full_attention": {...}, ...}) or one for all layers.
    nested = [value for value in parameters.values() if isinstance(value, Mapping)]
    for rope in nested or [parameters]:
        original = rope.get("original_max_position_embeddings")
        if rope.get("rope_type") == "longrope" and isinstance(original, int):
            return int(model_config.max_model_len) > original
    return False


def engine_only_identity(vllm_config: Any, why: str) -> str:
    """An identity no other engine has: every process of this engine shares vLLM's ids for it.

    vLLM's `kv_transfer_config.engine_id` (a new UUID per engine unless
    an operator names it) and `instance_id` (new per start) reach the
    scheduler and each worker in the same `VllmConfig`.
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    engine_id = str(getattr(transfer, "engine_id", "") or "")
    instance_id = str(getattr(vllm_config, "instance_id", "") or "")
    if not engine_id and not instance_id:
        # No ids to agree on: this process alone.
        instance_id = uuid.uuid4().hex
    unique = hashlib.sha256(f"{engine_id}\0{instance_id}".encode()).hexdigest()[:32]
    return f"engine-only:{unique};{why}"


def _config_identity(path: str, hub_caches: list[str]) -> str:
    try:
        return model_identity(path, hub_caches=hub_caches)
    except ModelIdentityError:
        raise VLLMConfigError(
            f"model_config.hf_config_path: kvwire cannot read the configuration at "
            f"{shown(path)} that vLLM computes with; make it readable, or give it as a local "
            "directory or a hub id whose commit is in the local hub cache"
        ) from None


def _cache_dtype(vllm_config: Any) -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype in (None, "auto"):
        return kv_dtype_name(vllm_config.model_config.dtype, "model_config.dtype")
    # vLLM names fp8 caches "fp8"/"fp8_e4m3"/"fp8_e5m2"; the bytes are torch's float8 types.
    fp8_names = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
    if cache_dtype in fp8_names:
        return fp8_names[cache_dtype]
    return kv_dtype_name(cache_dtype, "cache_config.cache_dtype")


def _transfer_config_from_vllm(vllm_transfer: Any, profile: EngineConfig) -> KVTransferConfig:
    """The profile's kvwire connector, with vLLM's role, engine id and failure policy."""
    wrapped = profile.kv_transfer_config
    if wrapped is None or wrapped.kv_connector is None:
        raise VLLMConfigError(
            "the kvwire profile must name the connector to wrap in "
            "kv_transfer_config.kv_connector (e.g. CPUOffloadConnector)"
        )
    return attrs.evolve(
        wrapped,
        engine_id=vllm_transfer.engine_id,
        kv_role=vllm_transfer.kv_role,
        kv_load_failure_policy=vllm_transfer.kv_load_failure_policy,
    )


def config_before_kv_cache(vllm_config: Any, profile: EngineConfig) -> EngineConfig:
    """`profile` with what vLLM decides before its KV cache exists, checked as the connector does.

    vLLM's role, engine id and failure policy, its parallel layout (rank
    0's), and its KV dtype checked: `engine_config_from_vllm` refuses
    the same things, but only once vLLM has loaded the model and sized its
    cache. The model's identity (a digest of its weights) and whether a
    hybrid cache is served wait for that.
    """
    _cache_dtype(vllm_config)
    return attrs.evolve(
        profile,
        parallel_config=parallel_config_from_vllm(vllm_config),
        kv_transfer_config=_transfer_config_from_vllm(vllm_config.kv_transfer_config, profile),
    )


def kv_cache_config_from_vllm(vllm_kv_cache_config: Any) -> KVCacheConfig:
    """kvwire's `KVCacheConfig` from vLLM's (`KVCacheTensor.size`/`layers` included)."""
    groups = [
        KVCacheGroupSpec(
            layer_names=list(group.layer_names), kv_cache_spec=_attention_spec(group.kv_cache_spec)
        )
        for group in vllm_kv_cache_config.kv_cache_groups
    ]
    tensors = [
        KVCacheTensor(size_bytes=int(tensor.size), shared_by=list(tensor.layers))
        for tensor in vllm_kv_cache_config.kv_cache_tensors
    ]
    return KVCacheConfig(
        num_blocks=int(vllm_kv_cache_config.num_blocks),
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
    )


def _attention_spec(spec: Any) -> AttentionSpec:
    block_size, num_kv_heads = int(spec.block_size), int(spec.num_kv_heads)
    head_size = int(spec.head_size)
    dtype = kv_dtype_name(spec.dtype, f"kv_cache_config's {type(spec).__name__}.dtype")
    kind = type(spec).__name__
    if kind == "SlidingWindowSpec":
        return SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            sliding_window=int(spec.sliding_window),
        )
    if kind == "FullAttentionSpec":
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
        )
    raise VLLMConfigError(
        f"kv_cache_config: a KV cache group has a {kind}; kvwire moves FullAttentionSpec and "
        "SlidingWindowSpec groups"
    )
