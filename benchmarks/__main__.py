"""Run every benchmark: ``python -m benchmarks [--quick] [--only NAME ...]``.

Each benchmark module exposes ``run(output_dir, quick) -> dict`` and writes its
own JSON (and plot) into ``output_dir``; this collects them in one summary.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pathlib
import sys

from benchmarks.rounds import FULL_REPEATS, QUICK_REPEATS, positive_int

BENCHMARKS = (
    "engine",
    "connectors",
    "memory",
    "hybrid",
    "redis",
    "redis-cluster",
    "mac",
    "weight-digest",
    "tiers",
    "peer",
    "vllm",
    "serve",
    "serve-chunked",
    "serve-tp2",
    "serve-tiers",
)
# These need vLLM, which lives in its own venv (.venv-vllm): run them by name there.
NEEDS_VLLM = ("vllm", "serve", "serve-chunked", "serve-tp2", "serve-tiers")
# These run their configurations in interleaved rounds (benchmarks.rounds): --repeats is theirs.
INTERLEAVED = ("serve", "serve-chunked", "serve-tp2", "serve-tiers")
DEFAULT_BENCHMARKS = tuple(
    name
    for name in BENCHMARKS
    if name not in NEEDS_VLLM or importlib.util.find_spec("vllm") is not None
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(DEFAULT_BENCHMARKS))
    parser.add_argument(
        "--repeats",
        type=positive_int,
        help=(
            f"rounds of every configuration in the serving benchmarks ({', '.join(INTERLEAVED)}); "
            f"default {FULL_REPEATS} for a full run, {QUICK_REPEATS} with --quick"
        ),
    )
    parser.add_argument(
        "--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks/results")
    )
    args = parser.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in args.only:
        module = importlib.import_module(f"benchmarks.{name.replace('-', '_')}")
        print(f"== {name}", flush=True)
        if name in INTERLEAVED:
            summary[name] = module.run(args.output_dir, args.quick, repeats=args.repeats)
        else:
            summary[name] = module.run(args.output_dir, args.quick)
    # A run of some benchmarks (--only, or vllm from its own venv) updates
    # their entries and keeps the others' from earlier runs.
    summary_path = args.output_dir / "summary.json"
    merged = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    merged.update(summary)
    summary_path.write_text(json.dumps(merged, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
