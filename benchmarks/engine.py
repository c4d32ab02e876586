"""The engine's own overhead, and what a warm connector does to time to first token.

Two figures, each a ratio against a bound measured in the same run:

- ``overhead_ratio_<preset>``: the engine's bookkeeping per step (scheduling,
  block manager, applying the step's results) divided by the model's forward
  pass time in the same steps, without a connector, for the ``tiny`` preset
  (the tests' model) and the ``bench`` preset. Lower is better; the forward
  pass is the bound.
- ``warm_ttft_speedup``: ``kvwire run``'s no-connector median time to first
  token divided by its warm median, on long prompts that share most of their
  tokens, with the CPU-offload connector and the ``bench`` preset. The
  no-connector pass is the bound; outputs must be identical.

``python -m benchmarks.engine [--quick]`` or ``python -m benchmarks --only engine``.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import attrs

from benchmarks.common import main as run_from_command_line
from benchmarks.common import pyplot, write_json
from kvwire.config import EngineConfig
from kvwire.engine.engine import LLMEngine
from kvwire.engine.passes import compare_passes
from kvwire.engine.presets import apply_preset
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from kvwire.profile import load_profile

CPU_OFFLOAD_PROFILE = pathlib.Path(__file__).parents[1] / "containers" / "cpu-offload.yaml"


def measure_overhead(preset: str, quick: bool) -> dict[str, Any]:
    """Engine bookkeeping against forward-pass time, per step, without a connector."""
    config = apply_preset(EngineConfig(), preset)
    config = attrs.evolve(
        config, cache_config=attrs.evolve(config.cache_config, num_gpu_blocks=1024)
    )
    spec = WorkloadSpec(
        num_requests=8 if quick else 16,
        prompt_len=128 if quick else 256,
        output_len=16 if quick else 32,
        shared_prefix_ratio=0.5,
        vocab_size=config.model_config.vocab_size,
    )
    with LLMEngine(config) as engine:
        engine.generate(synthetic_workload(spec))
        counters = engine.counters
    bookkeeping = counters.schedule_s + counters.update_s
    return {
        "preset": preset,
        "steps": counters.steps,
        "bookkeeping_ms_per_step": 1000 * bookkeeping / counters.steps,
        "forward_ms_per_step": 1000 * counters.worker_s / counters.steps,
        "overhead_ratio": bookkeeping / counters.worker_s,
    }


def measure_warm_ttft(quick: bool) -> dict[str, Any]:
    """``kvwire run``'s three passes on long shared prompts with CPU offload."""
    config = apply_preset(load_profile(CPU_OFFLOAD_PROFILE), "bench")
    config = attrs.evolve(
        config, cache_config=attrs.evolve(config.cache_config, num_gpu_blocks=1024)
    )
    spec = WorkloadSpec(
        num_requests=4 if quick else 8,
        prompt_len=512 if quick else 1024,
        output_len=4,
        shared_prefix_ratio=0.9,
        vocab_size=config.model_config.vocab_size,
    )
    # The process itself speeds up over its first seconds (allocator, caches),
    # which would flatter whichever pass runs last: the figures come from a
    # second, identical run, once the process has settled.
    for _ in range(1 if quick else 2):
        report = compare_passes(config, synthetic_workload(spec))
    passes = report["passes"]
    return {
        "workload": attrs.asdict(spec),
        "passes": passes,
        "warm_ttft_speedup": passes["no connector"]["ttft_p50_ms"] / passes["warm"]["ttft_p50_ms"],
        "outputs_identical": report["ok"],
    }


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    overhead = [measure_overhead(preset, quick) for preset in ("tiny", "bench")]
    ttft = measure_warm_ttft(quick)
    write_json(output_dir, "engine.json", {"overhead": overhead, "warm_ttft": ttft})
    _plot(overhead, ttft, output_dir / "engine.png")
    summary: dict[str, Any] = {
        f"overhead_ratio_{row['preset']}": round(row["overhead_ratio"], 3) for row in overhead
    }
    summary["warm_ttft_speedup"] = round(ttft["warm_ttft_speedup"], 2)
    summary["outputs_identical"] = ttft["outputs_identical"]
    return summary


def _plot(overhead: list[dict[str, Any]], ttft: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    presets = [row["preset"] for row in overhead]
    positions = range(len(presets))
    left.bar(
        [p - 0.2 for p in positions],
        [row["forward_ms_per_step"] for row in overhead],
        width=0.4,
        label="forward pass (bound)",
    )
    left.bar(
        [p + 0.2 for p in positions],
        [row["bookkeeping_ms_per_step"] for row in overhead],
        width=0.4,
        label="engine bookkeeping",
    )
    left.set_xticks(list(positions), presets)
    left.set_ylabel("ms per step")
    left.set_yscale("log")
    left.set_title("Engine overhead per step")
    left.legend()
    names = list(ttft["passes"])
    right.bar(names, [ttft["passes"][name]["ttft_p50_ms"] for name in names], color="C2")
    right.set_ylabel("time to first token, p50 (ms)")
    right.set_title(f"CPU offload, {ttft['workload']['prompt_len']}-token shared prompts")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line("python -m benchmarks.engine", run, argv)


if __name__ == "__main__":
    sys.exit(main())
