"""Run one workload three ways (no connector, cold, warm) and measure each pass.

Cold and warm share one engine, so the connector's store (a CPU pool lives in
the worker's memory) survives between them; before the warm pass the
engine's local prefix cache is emptied, so every shared prefix must come back
through the connector.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput, WorkerMode

PASSES = ("no connector", "cold", "warm")


def compare_passes(
    config: EngineConfig,
    workload: Sequence[GenerationRequest],
    *,
    worker_mode: WorkerMode = "inline",
    on_request_done: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The figures of each pass, and whether all outputs equal the no-connector ones."""
    baseline_config = attrs.evolve(config, kv_transfer_config=None)
    with LLMEngine(baseline_config, worker_mode=worker_mode) as engine:
        _warm_up(engine, workload)
        baseline = _run_pass(engine, workload, "no connector", on_request_done)
    with LLMEngine(config, worker_mode=worker_mode) as engine:
        _warm_up(engine, workload)
        cold = _run_pass(engine, workload, "cold", on_request_done)
        engine.reset_prefix_cache()
        warm_workload = [attrs.evolve(r, request_id=f"{r.request_id}/warm") for r in workload]
        warm = _run_pass(engine, warm_workload, "warm", on_request_done)
    bytes_per_token = _bytes_per_token(config)
    figures = {
        name: _figures(outputs, elapsed, stats, bytes_per_token)
        for name, (outputs, elapsed, stats) in zip(PASSES, (baseline, cold, warm), strict=True)
    }
    reference = [output.output_token_ids for output in baseline[0]]
    base = figures["no connector"]
    for name, (outputs, _elapsed, _stats) in zip(PASSES, (baseline, cold, warm), strict=True):
        row = figures[name]
        row["outputs_identical"] = [output.output_token_ids for output in outputs] == reference
        row["speedup"] = base["total_s"] / row["total_s"] if row["total_s"] else None
        row["ttft_p50_speedup"] = (
            base["ttft_p50_ms"] / row["ttft_p50_ms"] if row["ttft_p50_ms"] else None
        )
    transfer = config.kv_transfer_config
    return {
        "connector": transfer.kv_connector if transfer else None,
        "model": attrs.asdict(config.model_config),
        "block_size": config.cache_config.block_size,
        "worker_mode": worker_mode,
        "passes": figures,
        "ok": all(
            row["outputs_identical"] and not row["failed_requests"] for row in figures.values()
        ),
    }


def _warm_up(engine: LLMEngine, workload: Sequence[GenerationRequest]) -> None:
    """One untimed request as long as the longest prompt, so no pass pays for first use.

    (The first large tensors of a process cost more: allocator growth, kernel
    set-up.) Its prompt is a block of token 0 then token 1s, so it shares no
    block hash with the workload unless a prompt starts with a block of zeros.
    """
    block_size = engine.config.cache_config.block_size
    longest = max(len(request.prompt_token_ids) for request in workload)
    length = max(block_size + 1, min(longest, engine.config.model_config.max_model_len - 2))
    prompt = (0,) * block_size + (1,) * (length - block_size)
    engine.generate([GenerationRequest("kvwire-warm-up", prompt, 2)])
    engine.reset_prefix_cache()


def _run_pass(
    engine: LLMEngine,
    workload: Sequence[GenerationRequest],
    label: str,
    on_request_done: Callable[[str], None] | None,
) -> tuple[list[RequestOutput], float, dict[str, Any]]:
    engine.connector_stats.reset()
    started = time.perf_counter()
    outputs = engine.generate(
        workload, None if on_request_done is None else (lambda _request: on_request_done(label))
    )
    elapsed = time.perf_counter() - started
    return outputs, elapsed, dict(engine.connector_stats.data)


def _bytes_per_token(config: EngineConfig) -> int:
    model = config.model_config
    return model.num_layers * 2 * model.num_kv_heads * model.head_size * model.dtype_size


def _figures(
    outputs: Sequence[RequestOutput],
    elapsed: float,
    stats: Mapping[str, Any],
    bytes_per_token: int,
) -> dict[str, Any]:
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    from_connector = sum(output.external_tokens for output in outputs)
    ttfts = sorted(
        output.time_to_first_token_s * 1000
        for output in outputs
        if output.time_to_first_token_s is not None
    )
    saved = _sum_counter(stats, "bytes_saved")
    loaded = _sum_counter(stats, "bytes_loaded")
    if loaded is None:
        # The connector does not count bytes; the engine knows what it received.
        loaded = from_connector * bytes_per_token
    moved = loaded + (saved or 0)
    return {
        "requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "tokens_from_connector": from_connector,
        "hit_rate": from_connector / prompt_tokens if prompt_tokens else 0.0,
        "ttft_p50_ms": _percentile(ttfts, 0.50),
        "ttft_p95_ms": _percentile(ttfts, 0.95),
        "total_s": elapsed,
        "bytes_saved": saved,
        "bytes_loaded": loaded,
        "effective_gb_per_s": moved / elapsed / 1e9 if elapsed else 0.0,
        "failed_requests": sum(1 for output in outputs if output.error is not None),
        "load_failures": sum(output.num_load_failures for output in outputs),
    }


def _sum_counter(stats: Mapping[str, Any], name: str) -> int | None:
    """``name`` summed over a stats tree (a composite nests its children's counters)."""
    found = False
    total = 0
    for key, value in stats.items():
        if isinstance(value, Mapping):
            nested = _sum_counter(value, name)
            if nested is not None:
                found, total = True, total + nested
        elif key == name and isinstance(value, int | float):
            found, total = True, total + int(value)
    return total if found else None


def _percentile(sorted_values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not sorted_values:
        return None
    rank = max(1, round(fraction * len(sorted_values) + 0.4999999))
    return sorted_values[min(rank, len(sorted_values)) - 1]
