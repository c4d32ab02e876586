"""Hybrid models: what window-aware saving spares a sliding-window group, and what it costs.

On the ``hybrid`` preset (full-attention and sliding-window layers
alternating; HMA on: one KV cache group per kind), long prompts with a
shared prefix and distinct tails run through the shared-storage and
CPU-offload connectors three ways, in one run:

- ``window-aware`` (the default): a sliding-window group saves only the
  windows where a later hit can end: at the end of each step's computed
  prefix, and where a request branches from a saved prefix (see
  :mod:`kvwire.connectors.offload._planner`);
- ``every block``: the same connector with ``window_aware_saves = False``
  (a benchmark-local subclass, swapped in through a private registry copy,
  so no user-facing option exists): every group saves every block it
  computes, as a connector unaware of windows would.
  Loads do not change: the planner loads a sliding-window group's window
  either way;
- ``HMA off`` (``disable_hybrid_kv_cache_manager=True``): one KV cache group
  of every layer, whose every block is saved and loaded, as with a
  connector that cannot serve HMA.

Each request runs alone: cold (it saves; the requests after the first find
the shared prefix in the engine's own cache), then warm in an engine whose
local prefix cache is empty (shared storage: a fresh engine on the same
directory; CPU offload: the same engine, whose worker holds the pool), so
that a warm request loads its whole prompt from the connector; the warm
requests run several rounds. One output token per request: the bytes are
the prompts'. The variants take turns request by request, in an order that
turns, so a machine whose speed drifts weighs on all of them alike. Every
output must equal the window-aware cold one.

Figures, each against a bound computed from the model config in the same
run (the goal, (full-attention layers + window/prompt x sliding
layers) / all layers, a request's sliding layers moving at most the window):

- ``saved_ratio``: bytes saved, window-aware over every block; the prompt
  in its goal is what each request saved (the shared prefix is saved
  once, by the first request; the others save their tails). Beside it
  ``saved_design_bound``, what the planner promises: a sliding layer saves
  the blocks its window reaches back from a block boundary and the one
  before (a prompt ending on that boundary hits a block earlier), so whole
  blocks, one more than the window, at most that much of each prompt;
- ``loaded_ratio``: bytes loaded per warm hit, window-aware over HMA off,
  over the warm requests both served; the prompt in its goal is the hit's
  tokens;
- ``warm_ttft_ratio``: window-aware warm time to first token over every
  block's, the median of the ratios within each turn, over the turns both
  served from the connector (goal: no worse, about 1.0 within noise).

The table also counts the first warm round's hits: a warm request the
connector did not serve recomputes its prompt (and saves its window whole,
so later rounds find it). The tails differ in length, from the full tail
down to an eighth of it for 8 requests, some shorter than the window, and
only the first prompt ends on a block boundary (see :func:`prompts`).

Each prompt is computed in one step (``max_num_batched_tokens`` >= the
prompt): a chunked prefill saves one window per chunk, since each chunk's
end is a prefix another request may hit.

``python -m benchmarks.hybrid [--quick]`` or ``python -m benchmarks --only
hybrid``; writes ``hybrid.json`` into the output directory and prints a
Markdown table.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
from dependency_injector import providers

from benchmarks.common import MIB, write_json
from benchmarks.common import main as run_from_command_line
from kvwire.blocks.groups import CacheGroup
from kvwire.config import (
    SLIDING_ATTENTION,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.container import container_for_profile
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.presets import apply_preset
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from kvwire.registry import ConnectorRegistry, default_registry

WINDOW_AWARE, EVERY_BLOCK, HMA_OFF = "window-aware", "every block", "HMA off"
VARIANTS = (WINDOW_AWARE, EVERY_BLOCK, HMA_OFF)
CONNECTORS = ("SharedStorageConnector", "CPUOffloadConnector")


# ------------------------------------------------------- the naive connectors


class EveryBlockSharedStorageConnector(SharedStorageConnector):
    """Shared storage whose sliding-window groups save every block (the naive figure)."""

    window_aware_saves = False


class EveryBlockCPUOffloadConnector(CPUOffloadConnector):
    """CPU offload whose sliding-window groups save every block (the naive figure)."""

    window_aware_saves = False


def every_block_registry() -> ConnectorRegistry:
    """A private registry in which the two connectors' names build the naive subclasses.

    The configs stay the same (same connector names and options); only the
    containers given this copy see the swap, so no user-facing option exists.
    """
    registry = default_registry().copy()
    registry.provider("SharedStorageConnector").override(
        providers.Object(EveryBlockSharedStorageConnector)
    )
    registry.provider("CPUOffloadConnector").override(
        providers.Object(EveryBlockCPUOffloadConnector)
    )
    return registry


# ----------------------------------------------------------------- the bounds


@attrs.frozen
class Layers:
    """How many layers of each kind the model has, and what a sliding layer moves per request."""

    full: int
    sliding: int
    window: int
    # What the planner saves of a sliding window at a request's end: the
    # blocks the window reaches back from a block boundary, and the block
    # before (a prompt ending on that boundary hits a block earlier).
    saved_window_tokens: int

    @classmethod
    def of(cls, model: ModelConfig, block_size: int) -> Layers:
        sliding = sum(1 for kind in model.layer_types if kind == SLIDING_ATTENTION)
        if not sliding or model.sliding_window is None:
            raise ValueError("the hybrid benchmark needs a model with sliding_attention layers")
        group = CacheGroup(0, (), block_size, model.sliding_window)
        assert group.window_blocks is not None
        saved = (group.window_blocks + 1) * block_size
        return cls(model.num_layers - sliding, sliding, model.sliding_window, saved)

    def goal_ratio(self, tokens: Sequence[int]) -> float:
        """The goal, (full + window/tokens x sliding) / all layers.

        Over requests that move ``tokens`` each (new tokens for a save, the
        hit for a load): full-attention layers move them all, sliding
        layers at most a window's worth.
        """
        return self._ratio(
            sum(self.full * t + self.sliding * min(t, self.window) for t in tokens), tokens
        )

    def design_ratio(self, tokens: Sequence[int], prompts: Sequence[int]) -> float:
        """What window-aware saving promises, in the goal's terms.

        Full-attention layers save each request's new ``tokens``; sliding
        layers at most :attr:`saved_window_tokens` of its prompt, new or not.
        """
        capped = (min(p, self.saved_window_tokens) for p in prompts)
        return self._ratio(
            sum(self.full * t + self.sliding * c for t, c in zip(tokens, capped, strict=True)),
            tokens,
        )

    def _ratio(self, layer_tokens: float, tokens: Sequence[int]) -> float:
        moved = sum(tokens)
        return layer_tokens / ((self.full + self.sliding) * moved) if moved else float("nan")


# ------------------------------------------------------------------ the engine


@attrs.frozen
class Setup:
    """One run's model, workload and connectors."""

    preset: str
    workload: WorkloadSpec
    block_size: int = 16
    connectors: tuple[str, ...] = CONNECTORS
    # Warm requests are cheap and their times short: several rounds steady the medians.
    warm_rounds: int = 1


def blocks_per_prompt(setup: Setup) -> int:
    return -(-setup.workload.prompt_len // setup.block_size) + 1


def engine_config(setup: Setup) -> EngineConfig:
    prompt = setup.workload.prompt_len
    return apply_preset(
        EngineConfig(
            cache_config=CacheConfig(
                block_size=setup.block_size,
                # Room for every request's blocks and a warm-up's: the cold
                # requests after the first find the shared prefix in the local
                # cache, as a server's would.
                num_gpu_blocks=blocks_per_prompt(setup) * (setup.workload.num_requests + 2),
            ),
            # The prompt in one step (see the module's docstring).
            scheduler_config=SchedulerConfig(max_num_batched_tokens=max(512, prompt)),
        ),
        setup.preset,
    )


def variant_config(
    setup: Setup, connector: str, variant: str, scratch: pathlib.Path
) -> EngineConfig:
    base = engine_config(setup)
    # Sized to the run, with room to spare for entry headers: a full pool
    # would evict, full staging would drop saves, and each skews the bytes.
    # Each request's saves are waited for, so staging holds one prompt's.
    every_block = base.kv_cache_bytes // base.cache_config.num_gpu_blocks
    extra: dict[str, Any]
    if connector == "SharedStorageConnector":
        extra = {
            "shared_storage_path": str(scratch / variant.replace(" ", "-")),
            "max_save_bytes_in_flight": 2 * blocks_per_prompt(setup) * every_block + MIB,
        }
    else:
        extra = {"cpu_pool_bytes": 2 * base.kv_cache_bytes + MIB}
    config = attrs.evolve(
        base,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )
    if variant == HMA_OFF:
        config = attrs.evolve(
            config,
            scheduler_config=attrs.evolve(
                config.scheduler_config, disable_hybrid_kv_cache_manager=True
            ),
        )
    return config


def open_engine(config: EngineConfig, variant: str, prompt_len: int) -> LLMEngine:
    container = None
    if variant == EVERY_BLOCK:
        container = container_for_profile(config, registry=every_block_registry())
    engine = LLMEngine(config, container=container)
    try:
        _warm_up(engine, prompt_len)
    except BaseException:
        engine.close()
        raise
    return engine


def _warm_up(engine: LLMEngine, length: int) -> None:
    """One untimed request as long as the prompts, sharing no block with them.

    The first large tensors of an engine cost more (allocator growth, kernel
    set-up); its saves are waited for and its stats dropped.
    """
    block_size = engine.config.cache_config.block_size
    prompt = (0,) * block_size + (1,) * (length - block_size)
    engine.generate([GenerationRequest("hybrid-warm-up", prompt, 2)])
    engine.wait_for_saves()
    engine.reset_prefix_cache()
    engine.connector_stats.reset()


@attrs.frozen
class Served:
    """One request in one engine: its output and what its connector moved."""

    output: RequestOutput
    bytes_saved: int
    bytes_loaded: int


def serve(engine: LLMEngine, request: GenerationRequest, *, cold: bool) -> Served:
    """Run one request alone and take what its connector moved (its saves waited for)."""
    if not cold:
        # Every warm prompt must come back through the connector.
        engine.reset_prefix_cache()
    engine.connector_stats.reset()
    (output,) = engine.generate([request])
    engine.wait_for_saves()
    stats = engine.connector_stats.data
    if output.error is not None:
        raise RuntimeError(f"{request.request_id} failed: {output.error}")
    if stats.get("saves_dropped") or output.num_load_failures:
        raise RuntimeError(
            f"{request.request_id}: saves dropped or loads failed: the bytes would be wrong"
        )
    return Served(output, int(stats.get("bytes_saved", 0)), int(stats.get("bytes_loaded", 0)))


def take_turns(
    engines: dict[str, LLMEngine],
    requests: Sequence[GenerationRequest],
    *,
    cold: bool,
    tag: str,
    rounds: int = 1,
) -> dict[str, list[Served]]:
    """Each request in every variant's engine, request by request, ``rounds`` times.

    The variants' order turns by one each request, so that none always runs
    first (after another engine's request) or last.
    """
    served: dict[str, list[Served]] = {variant: [] for variant in engines}
    variants = list(engines)
    for round_index in range(rounds):
        for index, request in enumerate(requests):
            renamed = attrs.evolve(request, request_id=f"{request.request_id}/{tag}{round_index}")
            turn = (index + round_index) % len(variants)
            for variant in variants[turn:] + variants[:turn]:
                served[variant].append(serve(engines[variant], renamed, cold=cold))
    return served


@contextlib.contextmanager
def engines_for(
    configs: dict[str, EngineConfig], prompt_len: int
) -> Iterator[dict[str, LLMEngine]]:
    with contextlib.ExitStack() as stack:
        engines = {}
        for variant, config in configs.items():
            engines[variant] = stack.enter_context(open_engine(config, variant, prompt_len))
        yield engines


# ------------------------------------------------------------------ measuring


def bench_connector(
    setup: Setup,
    connector: str,
    requests: Sequence[GenerationRequest],
    scratch: pathlib.Path,
) -> dict[str, Any]:
    base = engine_config(setup)
    configs = {v: variant_config(setup, connector, v, scratch) for v in VARIANTS}
    if connector == "SharedStorageConnector":
        # A producer engine fills the directory; a fresh consumer engine reads it.
        with engines_for(configs, setup.workload.prompt_len) as engines:
            cold = take_turns(engines, requests, cold=True, tag="cold")
        with engines_for(configs, setup.workload.prompt_len) as engines:
            warm = take_turns(engines, requests, cold=False, tag="warm", rounds=setup.warm_rounds)
    else:
        # The pool lives in the worker: the warm pass runs in the same engine.
        with engines_for(configs, setup.workload.prompt_len) as engines:
            cold = take_turns(engines, requests, cold=True, tag="cold")
            warm = take_turns(engines, requests, cold=False, tag="warm", rounds=setup.warm_rounds)
    return figures(Layers.of(base.model_config, setup.block_size), base, cold, warm)


def figures(
    layers: Layers,
    config: EngineConfig,
    cold: dict[str, list[Served]],
    warm: dict[str, list[Served]],
) -> dict[str, Any]:
    model = config.model_config
    bytes_per_layer_token = 2 * model.num_kv_heads * model.head_size * model.dtype_size
    every_layer_token = bytes_per_layer_token * model.num_layers
    reference = [s.output.output_token_ids for s in cold[WINDOW_AWARE]]
    # A request whose prompt the connector did not serve moved nothing to count per hit.
    hits = {v: [s for s in warm[v] if s.output.external_tokens] for v in VARIANTS}
    rows: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        outputs = [s.output.output_token_ids for s in (*cold[variant], *warm[variant])]
        rows[variant] = {
            "warm_requests": len(warm[variant]),
            "saved_bytes_per_request": statistics.fmean(s.bytes_saved for s in cold[variant]),
            "loaded_bytes_per_warm_hit": _mean(s.bytes_loaded for s in hits[variant]),
            "warm_hits": len(hits[variant]),
            # A request its first warm round missed is recomputed and saved
            # whole, so later rounds find it: the first round is the figure.
            "first_round_warm_hits": sum(
                1 for s in warm[variant][: len(cold[variant])] if s.output.external_tokens
            ),
            "warm_hit_tokens": _mean(s.output.external_tokens for s in hits[variant]),
            "cold_ttft_p50_ms": _median_ms(cold[variant]),
            "warm_ttft_p50_ms": _median_ms(warm[variant]),
            "warm_ttft_ms": [_ms(s) for s in warm[variant]],
            # The warm rounds replay the cold requests, in order.
            "outputs_identical": outputs == reference * (len(outputs) // len(reference)),
        }
    aware, every = rows[WINDOW_AWARE], rows[EVERY_BLOCK]
    # What each request saved, in tokens of every layer: the naive figure's own bytes.
    tokens_saved = [s.bytes_saved // every_layer_token for s in cold[EVERY_BLOCK]]
    prompts = [len(s.output.prompt_token_ids) for s in cold[EVERY_BLOCK]]
    # Loads compared request by request, over the warm requests both served.
    both = [
        (a, b)
        for a, b in zip(warm[WINDOW_AWARE], warm[HMA_OFF], strict=True)
        if a.output.external_tokens and b.output.external_tokens
    ]
    return {
        "variants": rows,
        "saved_ratio": _ratio(aware["saved_bytes_per_request"], every["saved_bytes_per_request"]),
        "saved_goal": layers.goal_ratio(tokens_saved),
        "saved_design_bound": layers.design_ratio(tokens_saved, prompts),
        "loaded_ratio": _ratio(
            sum(a.bytes_loaded for a, _ in both), sum(b.bytes_loaded for _, b in both)
        ),
        "loaded_goal": layers.goal_ratio([a.output.external_tokens for a, _ in both]),
        "warm_ttft_ratio": _paired_ratio(warm[WINDOW_AWARE], warm[EVERY_BLOCK], hits_only=True),
        "warm_ttft_ratio_vs_hma_off": _paired_ratio(
            warm[WINDOW_AWARE], warm[HMA_OFF], hits_only=True
        ),
        "cold_ttft_ratio": _paired_ratio(cold[WINDOW_AWARE], cold[EVERY_BLOCK], hits_only=False),
        "outputs_identical": all(row["outputs_identical"] for row in rows.values()),
    }


def _mean(values: Iterable[float]) -> float:
    found = list(values)
    return statistics.fmean(found) if found else 0.0


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else float("nan")


def _paired_ratio(ours: Sequence[Served], theirs: Sequence[Served], *, hits_only: bool) -> float:
    """The median over turns of our time to first token over theirs.

    A turn runs one request in each variant back to back, so the two times
    of a pair saw the same machine; a ratio per pair leaves out its drift,
    which a ratio of two medians keeps. With ``hits_only``, a warm request
    either variant did not get from the connector is no warm hit to compare
    (the table counts the hits).
    """
    ratios = [
        _ms(a) / _ms(b)
        for a, b in zip(ours, theirs, strict=True)
        if not hits_only or (a.output.external_tokens and b.output.external_tokens)
    ]
    return float(statistics.median(ratios)) if ratios else float("nan")


def _ms(served: Served) -> float:
    ttft = served.output.time_to_first_token_s
    if ttft is None:
        raise RuntimeError(f"{served.output.request_id} has no first token")
    return 1000 * ttft


def _median_ms(served: Sequence[Served]) -> float:
    return float(statistics.median(_ms(s) for s in served))


def prompts(spec: WorkloadSpec) -> list[GenerationRequest]:
    """The workload's prompts: the shared prefix, then tails of lengths that differ.

    Request ``i`` of ``n`` keeps ``(n - i) / n`` of the full tail, less
    ``i`` tokens. Real tails differ in length, and some are shorter than a
    sliding window, which then reaches back into the shared prefix; and
    real prompts end anywhere in a block (the first here ends on a block
    boundary, where a warm hit stops a block short of the prompt's end).
    """
    shared = round(spec.prompt_len * spec.shared_prefix_ratio)
    tail = spec.prompt_len - shared
    requests = synthetic_workload(spec)
    count = len(requests)
    return [
        attrs.evolve(
            request,
            prompt_token_ids=request.prompt_token_ids[
                : shared + max(1, -(-tail * (count - index) // count) - index)
            ],
        )
        for index, request in enumerate(requests)
    ]


def measure(setup: Setup, scratch: pathlib.Path) -> dict[str, Any]:
    """Every connector of ``setup``, every variant; the figures per connector."""
    base = engine_config(setup)
    layers = Layers.of(base.model_config, setup.block_size)
    requests = prompts(attrs.evolve(setup.workload, vocab_size=base.model_config.vocab_size))
    return {
        "preset": setup.preset,
        "layers": attrs.asdict(layers),
        "block_size": setup.block_size,
        "workload": attrs.asdict(setup.workload),
        "prompt_lengths": [len(request.prompt_token_ids) for request in requests],
        "warm_rounds": setup.warm_rounds,
        "connectors": {
            connector: bench_connector(setup, connector, requests, scratch / connector)
            for connector in setup.connectors
        },
    }


# ---------------------------------------------------------------- reporting


def markdown_table(results: dict[str, Any]) -> str:
    """The run's table: one row per connector and variant, then the ratios and their goals."""
    lines = [
        "| connector | saving | saved per request | warm hits, first round | loaded per warm hit "
        "| tokens per warm hit | cold TTFT p50 | warm TTFT p50 | outputs identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for connector, found in results["connectors"].items():
        for variant, row in found["variants"].items():
            lines.append(
                f"| {_short(connector)} | {variant} | {_mib(row['saved_bytes_per_request'])} "
                f"| {row['first_round_warm_hits']}/{len(results['prompt_lengths'])} "
                f"| {_mib(row['loaded_bytes_per_warm_hit'])} | {row['warm_hit_tokens']:.0f} "
                f"| {row['cold_ttft_p50_ms']:.0f} ms | {row['warm_ttft_p50_ms']:.1f} ms "
                f"| {'yes' if row['outputs_identical'] else 'NO'} |"
            )
    lines += [
        "",
        "| connector | saved: window-aware / every block (goal; design bound) "
        "| loaded per hit: window-aware / HMA off (goal) "
        "| warm TTFT per turn: window-aware / every block (goal <= 1.0) |",
        "|---|---:|---:|---:|",
    ]
    for connector, found in results["connectors"].items():
        lines.append(
            f"| {_short(connector)} | {found['saved_ratio']:.3f} "
            f"({found['saved_goal']:.3f}; {found['saved_design_bound']:.3f}) "
            f"| {found['loaded_ratio']:.3f} ({found['loaded_goal']:.3f}) "
            f"| {found['warm_ttft_ratio']:.2f} |"
        )
    return "\n".join(lines)


def _short(connector: str) -> str:
    return {"SharedStorageConnector": "shared storage", "CPUOffloadConnector": "CPU offload"}.get(
        connector, connector
    )


def _mib(size: float) -> str:
    return f"{size / MIB:.2f} MiB"


def setup_for(quick: bool) -> Setup:
    return Setup(
        preset="hybrid",
        workload=WorkloadSpec(
            num_requests=4 if quick else 8,
            prompt_len=512 if quick else 2048,
            output_len=1,
            shared_prefix_ratio=0.75,
            seed=13,
        ),
        warm_rounds=1 if quick else 3,
    )


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvwire-bench-hybrid-", dir=output_dir))
    try:
        results = measure(setup_for(quick), scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["quick"] = quick
    write_json(output_dir, "hybrid.json", results)
    print(markdown_table(results), flush=True)
    summary: dict[str, Any] = {}
    for connector, found in results["connectors"].items():
        key = _short(connector).replace(" ", "_").lower()
        for figure in (
            "saved_ratio",
            "saved_goal",
            "saved_design_bound",
            "loaded_ratio",
            "loaded_goal",
        ):
            summary[f"{key}_{figure}"] = round(found[figure], 3)
        summary[f"{key}_warm_ttft_ratio"] = round(found["warm_ttft_ratio"], 2)
        summary[f"{key}_outputs_identical"] = found["outputs_identical"]
    return summary


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line("python -m benchmarks.hybrid", run, argv)


if __name__ == "__main__":
    sys.exit(main())
