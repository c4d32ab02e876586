"""Serving speed at tensor parallelism 2: each server's model split over both cores.

``.venv-vllm/bin/python -m benchmarks --only serve-tp2``: the serving
benchmark (:mod:`benchmarks.serve`: the same model, workload, client and
seeds, ``--max-num-batched-tokens 8192``) with every server at
``--tensor-parallel-size 2`` (vLLM's multiprocessing executor, one rank
bound to each core; nothing reserved, so vLLM's engine-core process, its
frontend, the client and kvwire's I/O threads share the ranks' cores, the
same for every configuration). Each rank's KV cache holds half the heads
of as many tokens as one TP=1 server's, and each rank's connector moves its
share of every block. Configurations: the limit (measured in the same run)
and kvwire's three media.

Writes ``serve-tp2.json``, ``serve-tp2.png`` and ``serve-tp2.md``.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import attrs

from benchmarks.rounds import default_repeats
from benchmarks.serve import FULL, LIMIT, QUICK, measure_serving

TENSOR_PARALLEL_SIZE = 2
SINGLE = (LIMIT, "kvwire CPU offload", "kvwire shared storage", "kvwire Redis")


def run(output_dir: pathlib.Path, quick: bool, repeats: int | None = None) -> dict[str, Any]:
    workload = attrs.evolve(QUICK if quick else FULL, tensor_parallel_size=TENSOR_PARALLEL_SIZE)
    return measure_serving(
        output_dir, workload, SINGLE, (), "serve-tp2", default_repeats(quick, repeats)
    )


if __name__ == "__main__":
    from benchmarks.common import main

    sys.exit(main("python -m benchmarks.serve_tp2", run, sys.argv[1:]))
