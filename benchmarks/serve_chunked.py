"""Serving speed at vLLM's default ``max_num_batched_tokens`` (2048: chunked prefill).

``.venv-vllm/bin/python -m benchmarks --only serve-chunked``: the serving
benchmark (:mod:`benchmarks.serve`: the same model, workload, client, core
pinning and seeds) with each server's steps capped at 2048 tokens, so a
1056-token prompt's prefill spans steps and a load lands while other
requests' chunks run. Configurations: the limit (vLLM with a KV cache that
holds everything, measured in the same run) and kvwire's three media, the
rows the goals are set on; the two stores again with ``async_load`` (a
request's load runs in the background while other requests' steps go on,
and vLLM schedules the request once the load ended); ``--only serve`` has
the other rows at 8192.
Kept apart from ``--only serve`` so each stays within about 15 minutes.

Writes ``serve-chunked.json``, ``serve-chunked.png`` and ``serve-chunked.md``.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import attrs

from benchmarks.rounds import default_repeats
from benchmarks.serve import ASYNC_LOAD, FULL, LIMIT, QUICK, measure_serving

# vLLM's default for an online server (its --max-num-batched-tokens).
VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
SINGLE = (
    LIMIT,
    "kvwire CPU offload",
    "kvwire shared storage",
    "kvwire Redis",
    f"kvwire shared storage, {ASYNC_LOAD}",
    f"kvwire Redis, {ASYNC_LOAD}",
)


def run(output_dir: pathlib.Path, quick: bool, repeats: int | None = None) -> dict[str, Any]:
    workload = attrs.evolve(
        QUICK if quick else FULL, max_num_batched_tokens=VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS
    )
    return measure_serving(
        output_dir, workload, SINGLE, (), "serve-chunked", default_repeats(quick, repeats)
    )


if __name__ == "__main__":
    from benchmarks.common import main

    sys.exit(main("python -m benchmarks.serve_chunked", run, sys.argv[1:]))
