"""An engine process on a shared-storage directory, for the multi-process fault tests.

``python -m tests.support.processes.store --dir D --role kv_producer --rounds N``
runs N rounds of workloads (seeds 0, 1, ... modulo ``--distinct``) and
prints one JSON line per round: the tokens, the load failures and the
connector stats. ``--rounds 0`` runs until killed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import attrs
import torch

from kvwire.blocks.format import BlockLayout, CorruptBlockError, verify_entry
from kvwire.config import CacheConfig, EngineConfig, ModelConfig
from kvwire.engine.engine import LLMEngine
from tests.support.engines import shared_storage, workload


def big_block_config(**cache: object) -> EngineConfig:
    """Blocks of 128 KiB, so that a write takes long enough to be interrupted."""
    return EngineConfig(
        model_config=ModelConfig(
            num_layers=4,
            num_attention_heads=4,
            num_kv_heads=4,
            head_size=64,
            vocab_size=300,
            max_model_len=512,
        ),
        cache_config=CacheConfig(block_size=16, num_gpu_blocks=128, **cache),  # type: ignore[arg-type]
    )


def count_torn_entries(directory: str, layout: BlockLayout) -> int:
    """Visible entries (not temporary files) that are not whole and intact."""
    torn = 0
    for folder, _, names in os.walk(directory):
        for name in names:
            if name.startswith("."):
                continue
            with open(os.path.join(folder, name), "rb") as entry:
                data = entry.read()
            try:
                verify_entry(memoryview(data), layout, bytes.fromhex(name))
            except CorruptBlockError:
                torn += 1
    return torn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--role", default="kv_both")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--distinct", type=int, default=1000)
    parser.add_argument("--big", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = big_block_config() if args.big else None
    from tests.support.engines import tiny_config

    config = shared_storage(base or tiny_config(), args.dir)
    transfer = attrs.evolve(config.kv_transfer_config, kv_role=args.role)
    config = attrs.evolve(config, kv_transfer_config=transfer)
    rounds = itertools.count() if args.rounds == 0 else range(args.rounds)
    for number in rounds:
        seed = number % args.distinct
        requests = workload(seed=seed, prompt_len=70 if args.big else 30)
        with LLMEngine(config) as engine:
            engine.reset_prefix_cache()
            outputs = engine.generate(requests)
            stats = engine.connector_stats.reduce()
        leftovers = [
            name for _, _, names in os.walk(args.dir) for name in names if name.endswith(".tmp")
        ]
        torn = count_torn_entries(args.dir, BlockLayout.from_engine_config(config))
        line = {
            "seed": seed,
            "tokens": [list(output.output_token_ids) for output in outputs],
            "external_tokens": sum(output.external_tokens for output in outputs),
            "load_failures": sum(output.num_load_failures for output in outputs),
            "stats": stats,
            "leftover_tmp_files": leftovers,
            "torn_entries": torn,
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
