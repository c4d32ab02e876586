"""What every benchmark module shares: timing, results files, plots and its command line."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvwire.interface.base import KVConnectorBase, KVConnectorMetadata
from kvwire.interface.types import ForwardContext

KIB = 1024
MIB = 1024 * KIB


def best_seconds(
    actions: Mapping[str, Callable[[int], None]],
    repeats: int,
    before_each: Callable[[], None] | None = None,
) -> dict[str, float]:
    """The fastest of ``repeats`` timed calls of each action (given the repeat number).

    The actions take turns, repeat by repeat, so that a machine whose load or
    write-back state drifts during the run weighs on all of them alike.
    ``before_each`` runs untimed before every call (e.g. emptying a server).
    """
    best = dict.fromkeys(actions, float("inf"))
    for repeat in range(repeats):
        for name, action in actions.items():
            if before_each is not None:
                before_each()
            started = time.perf_counter()
            action(repeat)
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def run_step(
    connector: KVConnectorBase, metadata: KVConnectorMetadata, layers: tuple[str, ...]
) -> None:
    """One worker step as the engine drives it, without the model."""
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv(ForwardContext(layer_names=layers))
    for layer in layers:
        connector.wait_for_layer_load(layer)
    connector.wait_for_save()
    errors = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    if errors:
        raise RuntimeError(f"{len(errors)} blocks failed to load in the benchmark")
    stats = connector.get_kv_connector_stats()
    if stats is not None and stats.data.get("saves_dropped"):
        raise RuntimeError("saves were dropped: the benchmark would overstate throughput")


def size_label(size_bytes: int) -> str:
    """``256 KiB``, ``4 MiB``: how plots and summaries name a block size."""
    return f"{size_bytes // KIB} KiB" if size_bytes < MIB else f"{size_bytes // MIB} MiB"


def write_json(output_dir: pathlib.Path, name: str, data: Any) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / name).write_text(json.dumps(data, indent=2))


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def main(
    prog: str, run: Callable[[pathlib.Path, bool], dict[str, Any]], argv: list[str] | None
) -> int:
    """``python -m benchmarks.<name> [--quick] [--output-dir DIR]``: run one benchmark."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks/results")
    )
    args = parser.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(args.output_dir, args.quick), indent=2))
    sys.stdout.flush()
    return 0
