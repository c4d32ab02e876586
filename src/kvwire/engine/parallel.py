"""The engine's parallel layout: the KV heads and layers each rank holds, and its connector's view.

An engine config whose `parallel_config` asks for `tensor_parallel_size`
`tp` and `pipeline_parallel_size` `pp` runs `tp * pp` worker
processes. Rank `r` is tensor rank `r % tp` of stage `r // tp` (as
vLLM numbers its workers): it holds KV heads `[t * H / tp, (t + 1) * H /
tp)` (and their query heads) of its stage's layers, in a KV cache of that
share. Its connector sees what a vLLM worker's does: a model config of its
share (its heads, its stage's layer count, the whole model's identity, so
entries name the same weights at every parallel size), the cache config of
its layers, and its rank in `parallel_config`.
"""

from __future__ import annotations

import attrs

from kvwire.config import SLIDING_ATTENTION, EngineConfig, ParallelConfig
from kvwire.config.kv_cache import LAYER_NAME_FORMAT, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor


def stage_bounds(num_layers: int, pipeline_size: int) -> tuple[int, ...]:
    """Each stage's first layer, then `num_layers`: an even split, as vLLM splits.

    The layers left over go one each to the stages just before the last (the
    last stage also computes the logits).
    """
    counts = [num_layers // pipeline_size] * pipeline_size
    for stage in range(num_layers % pipeline_size):
        counts[-2 - stage] += 1
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return tuple(bounds)


def engine_parallel_config(config: EngineConfig) -> ParallelConfig:
    """`config`'s parallel layout at rank 0, stages filled in; `ValueError` naming the field.

    The engine runs `tensor_parallel_size * pipeline_parallel_size` ranks
    and numbers them itself, so `rank` stays 0 and `world_size` is that
    product.
    """
    parallel, model = config.parallel_config, config.model_config
    tensor_size, pipeline_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if parallel.rank != 0:
        raise ValueError(
            f"parallel_config.rank: {parallel.rank}, but the kvwire engine numbers its ranks "
            "itself; leave rank at 0"
        )
    if parallel.world_size != tensor_size * pipeline_size:
        raise ValueError(
            f"parallel_config.world_size: {parallel.world_size}, but the kvwire engine runs "
            f"exactly tensor_parallel_size x pipeline_parallel_size = "
            f"{tensor_size * pipeline_size} ranks; leave world_size unset"
        )
    if model.num_kv_heads % tensor_size:
        raise ValueError(
            f"parallel_config.tensor_parallel_size: {tensor_size} does not divide "
            f"model_config.num_kv_heads ({model.num_kv_heads}); expected a divisor of "
            f"{model.num_kv_heads}"
        )
    if pipeline_size > model.num_layers:
        raise ValueError(
            f"parallel_config.pipeline_parallel_size: {pipeline_size} stages for "
            f"model_config.num_layers {model.num_layers}; expected at most {model.num_layers}"
        )
    if parallel.pipeline_layers:
        if pipeline_size > 1 and parallel.pipeline_layers[-1] != model.num_layers:
            raise ValueError(
                f"parallel_config.pipeline_layers: {list(parallel.pipeline_layers)[:8]} ends at "
                f"{parallel.pipeline_layers[-1]}, but model_config.num_layers is "
                f"{model.num_layers}; the last number is the model's layer count"
            )
        return parallel
    if pipeline_size == 1:
        return parallel
    return attrs.evolve(parallel, pipeline_layers=stage_bounds(model.num_layers, pipeline_size))


@attrs.frozen
class RankShare:
    """What rank `parallel.rank` holds and what its connector is built from."""

    parallel: ParallelConfig
    kv_heads: range
    """The model's KV heads this rank holds (its cache's heads, in order)."""
    query_heads: range
    """The query heads that attend to them."""
    layers: range
    """The model's layers this rank holds."""
    connector_config: EngineConfig
    """The engine config its connector gets: the model config of its share, its rank."""
    kv_cache_config: KVCacheConfig
    """Its KV cache: its layers, its heads, the engine's block count."""

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(LAYER_NAME_FORMAT.format(index) for index in self.layers)


def rank_share(config: EngineConfig, kv_cache_config: KVCacheConfig, rank: int) -> RankShare:
    """Rank `rank`'s share of an engine of `config` whose whole cache is `kv_cache_config`.

    Raises `ValueError` (naming the field) for a parallel layout the engine
    cannot run, and for pipeline stages over several KV cache groups (a
    hybrid model under HMA), whose layers a stage would not hold in order.
    """
    parallel = attrs.evolve(engine_parallel_config(config), rank=rank)
    if parallel.pipeline_parallel_size > 1 and kv_cache_config.is_hybrid:
        raise ValueError(
            f"parallel_config.pipeline_parallel_size: {parallel.pipeline_parallel_size} with "
            f"{len(kv_cache_config.kv_cache_groups)} KV cache groups (a hybrid model under the "
            "hybrid KV cache manager); set scheduler_config.disable_hybrid_kv_cache_manager: "
            "true, or pipeline_parallel_size: 1"
        )
    model = config.model_config
    tensor_size = parallel.tensor_parallel_size
    kv_per_rank = model.num_kv_heads // tensor_size
    query_per_rank = model.num_attention_heads // tensor_size
    tensor_rank = parallel.tensor_rank
    layers = parallel.stage_layers(parallel.pipeline_rank) or range(model.num_layers)
    layer_types = model.layer_types[layers.start : layers.stop]
    share_model = attrs.evolve(
        model,
        num_kv_heads=kv_per_rank,
        num_attention_heads=query_per_rank,
        num_layers=len(layers),
        layer_types=layer_types,
        # A stage of full-attention layers only has no window to name.
        sliding_window=model.sliding_window if SLIDING_ATTENTION in layer_types else None,
        identity=model.weights_identity,
    )
    names = {LAYER_NAME_FORMAT.format(index) for index in layers}
    groups = [
        KVCacheGroupSpec(
            layer_names=[name for name in group.layer_names if name in names],
            kv_cache_spec=attrs.evolve(group.kv_cache_spec, num_kv_heads=kv_per_rank),
        )
        for group in kv_cache_config.kv_cache_groups
    ]
    page_size = groups[0].kv_cache_spec.page_size_bytes
    tensors = [
        KVCacheTensor(
            size_bytes=page_size * kv_cache_config.num_blocks,
            shared_by=[name for name in tensor.shared_by if name in names],
        )
        for tensor in kv_cache_config.kv_cache_tensors
        if any(name in names for name in tensor.shared_by)
    ]
    return RankShare(
        parallel=parallel,
        kv_heads=range(tensor_rank * kv_per_rank, (tensor_rank + 1) * kv_per_rank),
        query_heads=range(tensor_rank * query_per_rank, (tensor_rank + 1) * query_per_rank),
        layers=layers,
        connector_config=attrs.evolve(config, model_config=share_model, parallel_config=parallel),
        kv_cache_config=KVCacheConfig(
            num_blocks=kv_cache_config.num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
        ),
    )
