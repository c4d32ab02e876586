"""`kvwire replay TRACE.jsonl`: how big a CPU pool, which policy, answered from a request trace.

The trace's requests go through the CPU pool's own index at each pool size
asked for, with each eviction policy and save threshold; each configuration's
hit rate is printed beside Belady's optimum at that size (a table, `--json`,
or a curve drawn with `--plot`). `--generate` writes a synthetic trace in the
same form instead, to try it on. Every refusal is one line naming what to
fix, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import attrs

from kvwire.common.redaction import shown
from kvwire.config.bounded_file import shown_path
from kvwire.config.extra_config import parse_size
from kvwire.exceptions import KVWireError, MissingExtraError
from kvwire.interface.types import BlockHash
from kvwire.registry import default_registry
from kvwire.replay.plot import plot_hit_rates, require_matplotlib
from kvwire.replay.sweep import POLICIES, SAVE_THRESHOLDS, SweepRow, sweep
from kvwire.replay.synthetic import DEFAULT_SHAPE, SHAPES, generate_requests, named_shape
from kvwire.replay.trace import TraceRequest, read_trace, write_trace

DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1)
# 16 Mi slots: a TiB of 64 KiB blocks. The index lists its free slots up
# front, so a pool's size is bounded like any input that takes memory.
MAX_POOL_BLOCKS = 2**24
MAX_SIZES = 64
MAX_GENERATED_REQUESTS = 1_000_000
MAX_SAVE_THRESHOLD = 64
# Each worker holds the whole trace: a bound on the memory they take.
MAX_JOBS = 64
_LONGEST_ITEM = 40
_STATUS_REFUSED = 2


class _Refused(KVWireError):
    """What the user asked for cannot be done; the message says why."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add `kvwire replay`'s arguments to `parser`."""
    parser.description = (
        "Replay a request trace (JSONL: timestamp, input_length, output_length, hash_ids a "
        "line) through the CPU pool's own index at each pool size, with each eviction policy "
        "and save threshold, and compare each hit rate with Belady's offline optimum at that "
        "size. Or write a synthetic trace to try it on: kvwire replay --generate t.jsonl && "
        "kvwire replay t.jsonl"
    )
    parser.add_argument(
        "trace",
        nargs="?",
        metavar="TRACE.jsonl",
        help="the trace, one request a line: {timestamp, input_length, output_length, "
        "hash_ids: [one int per block of the prompt]}",
    )
    sizes = parser.add_argument_group(
        "pool sizes (one of; default: --fractions "
        + ",".join(str(f) for f in DEFAULT_FRACTIONS)
        + ")"
    )
    exclusive = sizes.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--blocks", metavar="N,N,...", type=_list_of(_pool_blocks), help="pool sizes in blocks"
    )
    exclusive.add_argument(
        "--bytes",
        metavar="SIZE,SIZE,...",
        type=_list_of(_byte_count),
        help="pool sizes in bytes (1GiB, 512MB), with --block-bytes",
    )
    exclusive.add_argument(
        "--fractions",
        metavar="F,F,...",
        type=_list_of(_fraction),
        help="pool sizes as fractions (0 to 1) of the trace's distinct blocks",
    )
    sizes.add_argument(
        "--block-bytes",
        metavar="SIZE",
        type=_byte_count,
        help="the bytes one block takes in the pool, for --bytes: K and V of every layer for "
        "one block, plus a 128-byte header",
    )
    configurations = parser.add_argument_group("configurations")
    configurations.add_argument(
        "--policies",
        metavar="NAME,...",
        type=_list_of(_policy_name),
        default=POLICIES,
        help=f"eviction policies to replay (default: {','.join(POLICIES)})",
    )
    configurations.add_argument(
        "--save-thresholds",
        metavar="N,...",
        type=_list_of(_save_threshold),
        default=SAVE_THRESHOLDS,
        help="save thresholds to replay: a block is saved once offered this many times "
        f"(default: {','.join(str(t) for t in SAVE_THRESHOLDS)})",
    )
    configurations.add_argument(
        "--jobs",
        metavar="N",
        type=_count(MAX_JOBS),
        help="worker processes replaying configurations at once (default: the CPUs this "
        "process may run on)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--json", action="store_true", help="print one JSON object per configuration"
    )
    output.add_argument(
        "--plot",
        metavar="FILE.png",
        type=pathlib.Path,
        help="draw hit rate against pool size per configuration and Belady's (needs "
        "matplotlib: pip install 'kvwire[bench]')",
    )
    generate = parser.add_argument_group("a synthetic trace")
    generate.add_argument(
        "--generate",
        metavar="OUT.jsonl",
        type=pathlib.Path,
        help="write a synthetic trace to OUT.jsonl instead of replaying",
    )
    generate.add_argument(
        "--shape",
        type=_shape_name,
        metavar="NAME",
        help=f"the traffic generated: {', '.join(SHAPES)} (default: {DEFAULT_SHAPE}, the "
        "tiers benchmark's; see docs/tiers.md)",
    )
    generate.add_argument(
        "--requests",
        type=_count(MAX_GENERATED_REQUESTS),
        metavar="N",
        help="requests of the generated trace (default: the shape's, "
        + ", ".join(f"{name} {shape.requests}" for name, shape in SHAPES.items())
        + ")",
    )
    generate.add_argument(
        "--seed",
        type=_count(2**32, lowest=0),
        metavar="S",
        help="seed of the generated trace (default: 33)",
    )


def run(args: argparse.Namespace) -> int:
    """Execute `kvwire replay`; the process exit status (2 when anything is refused)."""
    out, err = sys.stdout, sys.stderr
    try:
        if args.generate is not None:
            _generate(args, out)
        else:
            _replay(args, out, err)
    except (_Refused, ValueError, MissingExtraError) as error:
        print(f"kvwire replay: error: {error}", file=err)
        return _STATUS_REFUSED
    return 0


def _generate(args: argparse.Namespace, out: TextIO) -> None:
    given = [
        option
        for option, value in (
            ("TRACE.jsonl", args.trace),
            ("--blocks", args.blocks),
            ("--bytes", args.bytes),
            ("--fractions", args.fractions),
            ("--block-bytes", args.block_bytes),
            ("--jobs", args.jobs),
            ("--json", args.json or None),
            ("--plot", args.plot),
        )
        if value is not None
    ]
    if given:
        raise _Refused(
            f"--generate writes a trace and replays nothing, so {given[0]} does not apply; "
            "replay the trace written in a second command"
        )
    shape = named_shape(args.shape or DEFAULT_SHAPE)
    if args.requests is not None:
        shape = attrs.evolve(shape, requests=args.requests)
    if args.seed is not None:
        shape = attrs.evolve(shape, seed=args.seed)
    requests = shape.requests
    generated = generate_requests(shape)
    where = shown_path(args.generate)
    try:
        with open(args.generate, "w", encoding="utf-8") as file:
            write_trace(generated, file)
    except OSError as error:
        raise _Refused(f"--generate: {where}: cannot write it: {error.strerror}") from None
    accesses = sum(len(request.block_hashes) for request in generated)
    distinct = len({block for request in generated for block in request.block_hashes})
    print(
        f"kvwire replay: wrote {requests} requests ({accesses} block accesses, {distinct} "
        f"distinct blocks) to {where}",
        file=out,
    )


def _replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    if args.trace is None:
        raise _Refused("give a trace to replay (TRACE.jsonl), or --generate OUT.jsonl to write one")
    for option, value in (
        ("--shape", args.shape),
        ("--requests", args.requests),
        ("--seed", args.seed),
    ):
        if value is not None:
            raise _Refused(f"{option} applies to --generate only")
    if (args.bytes is None) != (args.block_bytes is None):
        raise _Refused("--bytes and --block-bytes go together: a pool's bytes over a block's")
    policies = tuple(dict.fromkeys(args.policies))
    _check_policies(policies)
    if args.plot is not None:
        # Before the replay, not after minutes of it.
        require_matplotlib()
    requests = read_trace(args.trace)
    trace: list[Sequence[BlockHash]] = [request.block_hashes for request in requests]
    distinct = len({block for hashes in trace for block in hashes})
    sizes = _pool_sizes(args, distinct)
    save_thresholds = tuple(dict.fromkeys(args.save_thresholds))
    progress = _Progress(err, len(sizes) * len(policies) * len(save_thresholds))
    try:
        rows = sweep(
            trace,
            sizes,
            policies=policies,
            save_thresholds=save_thresholds,
            on_replayed=progress.advance if err.isatty() else None,
            jobs=args.jobs or _usable_cpus(),
        )
    finally:
        progress.close()
    if args.plot is not None:
        title = f"{shown_path(args.trace)}: {len(requests)} requests, {distinct} distinct blocks"
        _plot(rows, args.plot, title)
    if args.json:
        for row in rows:
            print(json.dumps(attrs.asdict(row)), file=out)
    else:
        _print_table(requests, distinct, rows, out)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform says), at most MAX_JOBS."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(usable or 1, MAX_JOBS))


def _check_policies(policies: Sequence[str]) -> None:
    """Each name resolved before the trace is read: a typo is named at once."""
    registry = default_registry()
    for name in policies:
        try:
            registry.eviction_policies.get_class(name)
        except KVWireError as error:
            raise _Refused(f"--policies: {error}") from None


def _plot(rows: Sequence[SweepRow], path: pathlib.Path, title: str) -> None:
    try:
        plot_hit_rates(rows, path, title)
    except OSError as error:
        raise _Refused(f"--plot: {shown_path(path)}: cannot write it: {error.strerror}") from None


def _pool_sizes(args: argparse.Namespace, distinct: int) -> list[int]:
    """The pool sizes asked for, in blocks, smallest first, each once."""
    if args.blocks is not None:
        sizes = list(args.blocks)
    elif args.bytes is not None:
        sizes = []
        for size in args.bytes:
            blocks = size // args.block_bytes
            if not 1 <= blocks <= MAX_POOL_BLOCKS:
                raise _Refused(
                    f"--bytes: {size} bytes hold {blocks} blocks of {args.block_bytes} bytes; "
                    f"a pool holds 1 to {MAX_POOL_BLOCKS} blocks"
                )
            sizes.append(blocks)
    else:
        fractions = DEFAULT_FRACTIONS if args.fractions is None else args.fractions
        sizes = [min(max(1, round(fraction * distinct)), MAX_POOL_BLOCKS) for fraction in fractions]
    return sorted(set(sizes))


def _print_table(
    requests: Sequence[TraceRequest], distinct: int, rows: Sequence[SweepRow], out: TextIO
) -> None:
    asked = rows[0].asked_blocks if rows else 0
    print(
        f"{len(requests)} requests, {asked} block accesses, {distinct} distinct blocks",
        file=out,
    )
    print(file=out)
    table = [
        ["POOL BLOCKS", "POLICY", "SAVE_THRESHOLD", "HIT RATE", "BELADY", "OF BELADY", "WRITTEN"]
    ]
    for row in rows:
        table.append(
            [
                str(row.pool_blocks),
                row.policy,
                str(row.save_threshold),
                f"{row.hit_rate:.3f}",
                f"{row.belady_hit_rate:.3f}",
                "-" if row.ratio is None else f"{row.ratio:.2f}",
                str(row.blocks_written),
            ]
        )
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]
    for line in table:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip(),
            file=out,
        )
    print(file=out)
    print(
        "HIT RATE: blocks loaded from the pool (each request's prefix it held) over blocks "
        "asked for; BELADY: the offline optimum's at that size, which may keep any block; "
        "OF BELADY: their ratio; WRITTEN: blocks saved into the pool.",
        file=out,
    )


class _Progress:
    """`replayed N/M` redrawn in place on a terminal, erased when closed."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self._stream = stream
        self._total = total
        self._done = 0

    def advance(self, _replayed: object) -> None:
        self._done += 1
        self._stream.write(f"\rreplayed {self._done}/{self._total} configurations\x1b[K")
        self._stream.flush()

    def close(self) -> None:
        if self._done:
            self._stream.write("\r\x1b[K")
            self._stream.flush()


# ------------------------------------------------------- argument types


def _list_of(item: Callable[[str], object]) -> Callable[[str], tuple[object, ...]]:
    """An argparse type: comma-separated items, each read by `item`, at most `MAX_SIZES`."""

    def items(text: str) -> tuple[object, ...]:
        pieces = text.split(",", MAX_SIZES)
        if len(pieces) > MAX_SIZES:
            raise argparse.ArgumentTypeError(f"at most {MAX_SIZES} comma-separated values")
        return tuple(item(piece.strip()) for piece in pieces)

    return items


def _whole_number(text: str) -> int | None:
    # Digits counted before int(): a long number is no size, and int() refuses
    # thousands of digits anyway.
    if len(text) > _LONGEST_ITEM:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _count(limit: int, lowest: int = 1) -> Callable[[str], int]:
    def count(text: str) -> int:
        value = _whole_number(text)
        if value is None or not lowest <= value <= limit:
            raise argparse.ArgumentTypeError(
                f"expected a whole number from {lowest} to {limit}, got {_shown(text)}"
            )
        return value

    return count


_pool_blocks = _count(MAX_POOL_BLOCKS)
_save_threshold = _count(MAX_SAVE_THRESHOLD)


def _byte_count(text: str) -> int:
    value = parse_size(text) if len(text) <= _LONGEST_ITEM else None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes (4GiB, 512MB, 2097152), got {_shown(text)}"
        )
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text) if len(text) <= _LONGEST_ITEM else None
    except ValueError:
        value = None
    if value is None or not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"expected a fraction above 0, at most 1, got {_shown(text)}"
        )
    return value


def _policy_name(text: str) -> str:
    if not text or len(text) > 200:
        raise argparse.ArgumentTypeError(
            f"expected an eviction policy's name (lru, s3fifo, arc, kvfifo), got {_shown(text)}"
        )
    return text


def _shape_name(text: str) -> str:
    if text not in SHAPES:
        raise argparse.ArgumentTypeError(
            f"expected a trace shape's name ({', '.join(SHAPES)}), got {_shown(text)}"
        )
    return text


def _shown(text: str) -> str:
    return shown(text, limit=_LONGEST_ITEM)
