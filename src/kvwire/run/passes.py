"""Run one workload four ways (no connector, cold, warm, local) and measure each pass.

Cold and warm share one engine, so the connector's store (a CPU pool lives in
the worker's memory) survives between them; before the warm pass the
engine's local prefix cache is emptied, so every shared prefix must come back
through the connector. The local pass runs the warm workload in the
no-connector engine right after its own pass, with its prefix cache kept:
every prefix is already in the engine's blocks and there is no connector at
all, so nothing moves and nothing is asked. That is the limit a connector's
warm pass could at best match.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput, WorkerMode
from kvwire.engine.workload import renamed_requests

PASSES = ("no connector", "cold", "warm", "local")


def compare_passes(
    config: EngineConfig,
    workload: Sequence[GenerationRequest],
    *,
    worker_mode: WorkerMode | None = None,
    on_request_done: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The figures of each pass, and whether all outputs equal the no-connector ones.

    Each run starts cold: unless the profile names the model's identity, the
    connector's engine runs under an identity of this run's own, so nothing
    an earlier run stored (in a shared directory, a Redis server) is found,
    and what this run stored is forgotten again at its end.
    """
    baseline_config = attrs.evolve(config, kv_transfer_config=None)
    own_namespace = not config.model_config.identity
    if own_namespace:
        run_identity = f"kvwire-run-{uuid.uuid4().hex}"
        config = attrs.evolve(
            config, model_config=attrs.evolve(config.model_config, identity=run_identity)
        )
    with LLMEngine(baseline_config, worker_mode=worker_mode) as engine:
        _warm_up(engine, workload)
        baseline = _run_pass(engine, workload, "no connector", on_request_done)
        # No reset: the pass just run left every prefix in the engine's own cache.
        local = _run_pass(engine, renamed_requests(workload, "local"), "local", on_request_done)
    with LLMEngine(config, worker_mode=worker_mode) as engine:
        parallel = config.parallel_config
        ranks = {
            "tensor_parallel_size": parallel.tensor_parallel_size,
            "pipeline_parallel_size": parallel.pipeline_parallel_size,
            "worker_processes": len(engine.shares) or int(worker_mode == "process"),
        }
        hma = {
            "enabled": engine.hma_enabled,
            "reason": engine.hma.reason,
            "kv_cache_groups": len(engine.kv_cache_config.kv_cache_groups),
        }
        _warm_up(engine, workload)
        cold = _run_pass(engine, workload, "cold", on_request_done)
        engine.reset_prefix_cache()
        warm_workload = renamed_requests(workload, "warm")
        warm = _run_pass(engine, warm_workload, "warm", on_request_done)
        connector = engine.scheduler_connector
        if own_namespace and connector is not None:
            # The pass waited for its saves. Only this run's entries go: its
            # identity names their layout.
            connector.reset_cache()
    runs = (baseline, cold, warm, local)
    # A counter the connector reports in some pass counts as 0 in a pass where
    # it moved nothing; one it never reports stays None ("not reported").
    reported = _reported_counters(cold[2]) | _reported_counters(warm[2])
    figures = {
        name: _figures(outputs, elapsed, stats, reported if name in ("cold", "warm") else set())
        for name, (outputs, elapsed, stats) in zip(PASSES, runs, strict=True)
    }
    reference = [output.output_token_ids for output in baseline[0]]
    base = figures["no connector"]
    local_ttft = figures["local"]["ttft_p50_ms"]
    nothing_connected = _nothing_connected(figures, cold[2], warm[2])
    for name, (outputs, _elapsed, _stats) in zip(PASSES, runs, strict=True):
        row = figures[name]
        row["outputs_identical"] = [output.output_token_ids for output in outputs] == reference
        row["speedup"] = base["total_s"] / row["total_s"] if row["total_s"] else None
        row["ttft_p50_speedup"] = _ratio(base["ttft_p50_ms"], row["ttft_p50_ms"])
        row["ttft_p50_vs_local"] = _ratio(row["ttft_p50_ms"], local_ttft)
        if nothing_connected and name in ("cold", "warm"):
            # Faster or slower than no connector, a connector that moved nothing bought nothing.
            row["speedup"] = row["ttft_p50_speedup"] = row["ttft_p50_vs_local"] = None
    transfer = config.kv_transfer_config
    return {
        "connector": transfer.kv_connector if transfer else None,
        "model": attrs.asdict(config.model_config),
        "block_size": config.cache_config.block_size,
        "worker_mode": "process" if ranks["worker_processes"] else "inline",
        "parallel": ranks,
        "hma": hma,
        "passes": figures,
        # The goal figure: warm TTFT from the connector over TTFT with
        # the prefix in the engine's own cache (1.0 = the connector costs nothing).
        "warm_vs_local_ttft_p50": figures["warm"]["ttft_p50_vs_local"],
        "nothing_connected": nothing_connected,
        "ok": nothing_connected is None
        and all(
            row["outputs_identical"] and not row["failed_requests"] for row in figures.values()
        ),
    }


# Counters that count a transfer or a call that did not happen (save_errors,
# load_errors, redis_saves_dropped, peer_directory_failures, ...).
_FAILURE_SUFFIXES = ("_errors", "_failures", "_dropped", "_rejected", "_refused")


def _nothing_connected(
    figures: Mapping[str, Mapping[str, Any]], *pass_stats: Mapping[str, Any]
) -> dict[str, int] | None:
    """The failures a connector reported while it moved nothing at all, else None.

    A connector whose medium never answered (a Redis server that is not
    there) stores nothing, loads nothing and counts each save or call it
    could not make; the engine's outputs stay right, so only this says the
    run measured no connector. One that moved nothing and reported no
    failure (a workload without a full block) is not this.
    """
    moved = sum(
        figures[name][counter] or 0
        for name in ("cold", "warm")
        for counter in ("bytes_saved", "bytes_loaded", "tokens_from_connector")
    )
    failures: dict[str, int] = {}
    for stats in pass_stats:
        _add_failures(stats, failures)
    return failures if failures and not moved else None


def _add_failures(stats: Mapping[str, Any], failures: dict[str, int]) -> None:
    for key, value in stats.items():
        if isinstance(value, Mapping):
            _add_failures(value, failures)
        elif (
            isinstance(key, str)
            and key.endswith(_FAILURE_SUFFIXES)
            and isinstance(value, int | float)
            and value > 0
        ):
            failures[key] = failures.get(key, 0) + int(value)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


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
    # Its saves still running would count in the first pass's stats.
    engine.wait_for_saves()
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
    # Saves that outlive the pass's last request are this pass's: count them
    # here (not in the next pass, or nowhere), and let the warm pass find
    # their blocks stored. The wait is not the pass's time: no request waited.
    engine.wait_for_saves()
    return outputs, elapsed, dict(engine.connector_stats.data)


_TRANSFER_COUNTERS = ("bytes_saved", "bytes_loaded", "save_seconds", "load_seconds")


def _figures(
    outputs: Sequence[RequestOutput],
    elapsed: float,
    stats: Mapping[str, Any],
    reported: set[str],
) -> dict[str, Any]:
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    from_connector = sum(output.external_tokens for output in outputs)
    ttfts = sorted(
        output.time_to_first_token_s * 1000
        for output in outputs
        if output.time_to_first_token_s is not None
    )
    counters = {
        name: (_sum_counter(stats, name) or 0.0) if name in reported else None
        for name in _TRANSFER_COUNTERS
    }
    return {
        "requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "tokens_from_local_cache": sum(output.local_cached_tokens for output in outputs),
        "tokens_from_connector": from_connector,
        "hit_rate": from_connector / prompt_tokens if prompt_tokens else 0.0,
        "ttft_p50_ms": _percentile(ttfts, 0.50),
        "ttft_p95_ms": _percentile(ttfts, 0.95),
        "total_s": elapsed,
        "bytes_saved": _whole(counters["bytes_saved"]),
        "bytes_loaded": _whole(counters["bytes_loaded"]),
        "transfer_s": _total(counters["save_seconds"], counters["load_seconds"]),
        "effective_gb_per_s": _throughput(counters),
        "failed_requests": sum(1 for output in outputs if output.error is not None),
        "load_failures": sum(output.num_load_failures for output in outputs),
    }


def _reported_counters(stats: Mapping[str, Any]) -> set[str]:
    return {name for name in _TRANSFER_COUNTERS if _sum_counter(stats, name) is not None}


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def _total(*values: float | None) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def _throughput(counters: Mapping[str, float | None]) -> float | None:
    """Bytes moved over the time the connector's transfers took, in GB/s.

    Only directions the connector reports both bytes and seconds for count;
    None when there are none, or when nothing moved.
    """
    moved = seconds = 0.0
    for bytes_name, seconds_name in (
        ("bytes_saved", "save_seconds"),
        ("bytes_loaded", "load_seconds"),
    ):
        size, took = counters[bytes_name], counters[seconds_name]
        if size is not None and took is not None:
            moved, seconds = moved + size, seconds + took
    return moved / seconds / 1e9 if moved and seconds else None


def _sum_counter(stats: Mapping[str, Any], name: str) -> float | None:
    """`name` summed over a stats tree (a composite nests its children's counters)."""
    found = False
    total = 0.0
    for key, value in stats.items():
        if isinstance(value, Mapping):
            nested = _sum_counter(value, name)
            if nested is not None:
                found, total = True, total + nested
        elif key == name and isinstance(value, int | float):
            found, total = True, total + value
    return total if found else None


def _percentile(sorted_values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not sorted_values:
        return None
    rank = max(1, round(fraction * len(sorted_values) + 0.4999999))
    return sorted_values[min(rank, len(sorted_values)) - 1]
