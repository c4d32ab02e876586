"""`kvwire run [PROFILE]`: what a connector buys on a workload, measured four ways.

The workload runs without a connector, then with it cold (filling it), then
warm (the engine's local prefix cache emptied, so shared prefixes must come
back from the connector), and local (the workload again without a connector,
its prefix cache kept: nothing to move, the best a warm connector could
match). A table compares the passes; `--json` prints the
same figures for machines. The exit status is 1 when any pass's outputs
differ from the no-connector pass or a request failed.

No torch at import time: `kvwire --help` must stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from kvwire.config import EngineConfig
    from kvwire.engine.engine import GenerationRequest

# The workload is built in memory before it runs, and kept (every pass's
# outputs are compared): these bounds keep it to a few GiB at most, and a
# run at them already takes hours on the CPU engine.
MAX_REQUESTS = 100_000
# Prompt and output tokens, summed over the requests.
MAX_WORKLOAD_TOKENS = 2**24
# No model's max_model_len is longer (kvwire.config's limit on it).
MAX_LENGTH = 2**24
MAX_PARALLEL_SIZE = 2**16
MAX_SEED = 2**64
_LONGEST_NUMBER = 40

# What each row means, for `kvwire run --help`.
COLUMN_HELP = """\
table rows (one column per pass: no connector, cold = filling the connector,
warm = local prefix cache emptied, so shared prefixes come from the connector,
local = the workload again without a connector, the local prefix cache kept
from the no-connector pass: nothing to move, the best a warm pass could match):
  requests / prompt tokens   the workload, identical in every pass
  tokens from local cache    prompt tokens found in the engine's own prefix
                             cache (blocks computed or loaded by an earlier
                             request, also one admitted in the same step)
  tokens from connector      prompt tokens the connector supplied instead of
                             the model computing them
  hit rate                   tokens from connector / prompt tokens
  TTFT p50 / p95             time from a request's arrival (all arrive at the
                             start of the pass) to its first generated token
  total time                 wall time of the whole pass, until its last
                             request finished
  bytes saved / loaded       KV bytes the connector reports it stored / read,
                             saves that end after the last request included
                             (the run waits for them before the next pass)
  transfer time              seconds the connector reports its saves and loads
                             took, summed over transfers (parallel transfers
                             each count, so this can exceed the total time)
  effective GB/s             (bytes saved + bytes loaded) / transfer time: the
                             connector's own throughput while it moves bytes
  speed-up (total, TTFT p50) no-connector figure / this pass's figure
  TTFT p50 / local           this pass's TTFT p50 / the local pass's; under
                             the table, warm / local: how far the connector's
                             warm pass is from the engine's own prefix cache
  failed requests            requests that ended with an error
  outputs identical          generated tokens equal the no-connector pass's
'-' means not applicable, or not reported by the connector. The line under
the title says whether the hybrid KV cache manager (HMA) was on with the
connector, why (the HMA gate), and how many KV cache groups the cache had."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add `kvwire run`'s arguments to `parser`, and what its table's rows mean."""
    parser.description = (
        "Run a workload without a connector, then with it cold, then warm, and again "
        "without it with the local prefix cache kept; compare."
    )
    parser.epilog = COLUMN_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "profile",
        nargs="?",
        help="a shipped profile's name (kvwire profiles lists them) or a YAML file's path; "
        "default: cpu-offload",
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--requests",
        type=_count(MAX_REQUESTS),
        default=16,
        help=f"number of requests (at most {MAX_REQUESTS})",
    )
    workload.add_argument(
        "--prompt-len",
        type=_count(MAX_LENGTH),
        default=256,
        help="tokens per prompt (with --output-len, at most the model's max_model_len)",
    )
    workload.add_argument(
        "--output-len",
        type=_count(MAX_LENGTH),
        default=16,
        help="tokens to generate per request",
    )
    workload.add_argument(
        "--shared-prefix-ratio",
        type=_ratio,
        default=0.75,
        help="share of each prompt that all prompts have in common (0..1)",
    )
    workload.add_argument("--seed", type=_seed, default=0, help="seed of the synthetic prompts")
    workload.add_argument(
        "--prompts",
        type=pathlib.Path,
        metavar="FILE.jsonl",
        help='prompts, one JSON object a line: {"prompt": "text"} or {"prompt_token_ids": [...]}; '
        "a regular file of at most 16 MiB and 100000 lines",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--preset",
        help="replace the profile's model shape with a preset (tiny, bench, hybrid: "
        "sliding-window and full-attention layers, tiny-hybrid)",
    )
    engine.add_argument(
        "--worker-process",
        action="store_true",
        help="run the worker in its own process (metadata pickled every step)",
    )
    engine.add_argument(
        "--tensor-parallel-size",
        type=_count(MAX_PARALLEL_SIZE),
        metavar="N",
        help="split the KV heads over N worker processes (replaces the profile's "
        "parallel_config.tensor_parallel_size; N must divide the model's KV heads)",
    )
    engine.add_argument(
        "--pipeline-parallel-size",
        type=_count(MAX_PARALLEL_SIZE),
        metavar="N",
        help="split the layers over N stages, each in its own worker processes (replaces "
        "the profile's parallel_config.pipeline_parallel_size)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print the figures as JSON")
    output.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is only drawn when stderr is a terminal)",
    )


def _count(limit: int) -> Callable[[str], int]:
    """An argparse type: a whole number from 1 to `limit`; its error shows the text bounded."""

    def count(text: str) -> int:
        value = _whole_number(text)
        if value is None or not 1 <= value <= limit:
            raise argparse.ArgumentTypeError(
                f"expected a whole number from 1 to {limit}, got {_shown_text(text)}"
            )
        return value

    return count


def _seed(text: str) -> int:
    value = _whole_number(text)
    if value is None or abs(value) > MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from {-MAX_SEED} to {MAX_SEED}, got {_shown_text(text)}"
        )
    return value


def _whole_number(text: str) -> int | None:
    # Digits counted before int(): past Python's 4300-digit limit int()
    # raises, and a long number is no count a run can take anyway.
    if len(text.strip()) > _LONGEST_NUMBER:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _shown_text(text: str) -> str:
    from kvwire.common.redaction import shown

    return shown(text, limit=40)


def _ratio(text: str) -> float:
    try:
        value = float(text) if len(text) <= _LONGEST_NUMBER else None
    except ValueError:
        value = None
    if value is None:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {_shown_text(text)}")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Execute `kvwire run`; the process exit status."""
    from kvwire.registry import default_registry

    secrets = _profile_secrets(args.profile)
    try:
        _import_engine()
    except ImportError as error:
        _print_error(error, secrets)
        return 2
    from kvwire.config.profile import DEFAULT_PROFILE_NAME, profile_origin
    from kvwire.run.passes import PASSES, compare_passes
    from kvwire.run.report import format_table

    # What the profile's errors are prefixed with: the file (or shipped name) to fix.
    profile = profile_origin(args.profile or DEFAULT_PROFILE_NAME)
    try:
        config = _with_parallel_sizes(
            _load_config(args.profile, args.preset),
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
        )
        # Before the workload is built: a bad module path is named by its field at once.
        if config.kv_transfer_config is not None:
            default_registry().check_module_path(config.kv_transfer_config)
    except (ValueError, ImportError, OSError) as error:
        _print_error(error, secrets, profile)
        return 2
    try:
        workload = _build_workload(args, config)
    except (ValueError, ImportError, OSError) as error:
        _print_error(error, secrets)
        return 2
    progress = None
    if not args.no_progress and sys.stderr.isatty():
        progress = _ProgressBar(sys.stderr, len(PASSES) * len(workload))
    try:
        report = compare_passes(
            config,
            workload,
            # Unset: inline, or one process per rank when the model is split.
            worker_mode="process" if args.worker_process else None,
            on_request_done=None if progress is None else progress.advance,
        )
    except (ValueError, ImportError) as error:
        # Configuration the profile check cannot see until the connector is built:
        # an unknown name, a registered connector whose module fails to import,
        # the HMA gate, the connector's own extra-config checks.
        _print_error(error, secrets, profile)
        return 2
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0 if report["ok"] else 1


def _import_engine() -> None:
    """Import the engine (the torch extra's) now: missing, it is one line saying what to install."""
    from kvwire.common.extras import missing_extra

    try:
        importlib.import_module("kvwire.run.passes")
    except ModuleNotFoundError as error:
        missing = missing_extra(error, "kvwire run (its engine runs the model)")
        if missing is None:
            raise
        raise missing from None


def _profile_secrets(profile: str | None) -> set[str]:
    """The profile's secret values, for blanking wherever an error quotes one (as check does).

    A profile that cannot be read holds none to blank: loading it reports why.
    """
    from kvwire.common.redaction import secret_values
    from kvwire.config.profile import profile_path, read_profile_file

    if profile is None:
        return set()
    try:
        return secret_values(read_profile_file(profile_path(profile)))
    except (ValueError, OSError):
        return set()


def _print_error(error: Exception, secrets: set[str], profile: str | None = None) -> None:
    """Print `kvwire run: [PROFILE: ]error: ...`; `profile` names the profile the error is in."""
    from kvwire.common.redaction import scrub

    where = f"{profile}: " if profile is not None else ""
    # A connector's error may quote a secret by value from any field (a
    # password pasted into key_prefix), not only under a secret-like name.
    print(scrub(f"kvwire run: {where}error: {error}", secrets), file=sys.stderr)


def _load_config(profile: str | None, preset: str | None) -> EngineConfig:
    from kvwire.config.profile import DEFAULT_PROFILE_NAME, load_profile
    from kvwire.engine.presets import apply_preset

    profile = profile or DEFAULT_PROFILE_NAME
    config = load_profile(profile)
    transfer = config.kv_transfer_config
    if transfer is None or transfer.kv_connector is None:
        raise ValueError(
            f"profile {profile}: kv_transfer_config.kv_connector is not set; "
            "kvwire run compares a connector against none, so the profile must name one"
        )
    return config if preset is None else apply_preset(config, preset)


def _with_parallel_sizes(
    config: EngineConfig, tensor_size: int | None, pipeline_size: int | None
) -> EngineConfig:
    """`config` with the parallel sizes the flags give (None: the profile's)."""
    import attrs

    from kvwire.config import ParallelConfig

    if tensor_size is None and pipeline_size is None:
        return config
    parallel = config.parallel_config
    # A new layout: the engine splits the stages and counts the ranks itself.
    return attrs.evolve(
        config,
        parallel_config=ParallelConfig(
            tensor_parallel_size=tensor_size or parallel.tensor_parallel_size,
            pipeline_parallel_size=pipeline_size or parallel.pipeline_parallel_size,
        ),
    )


def _build_workload(args: argparse.Namespace, config: EngineConfig) -> list[GenerationRequest]:
    """The requests the flags describe, refused by flag before anything is built past a bound."""
    from kvwire.engine.workload import WorkloadSpec, load_prompts_jsonl, synthetic_workload

    model = config.model_config
    if args.prompts is not None:
        try:
            return load_prompts_jsonl(
                args.prompts, args.output_len, model.vocab_size, model.max_model_len
            )
        except ValueError as error:
            raise ValueError(f"--prompts: {error}") from None
    if args.prompt_len + args.output_len > model.max_model_len:
        raise ValueError(
            f"--prompt-len ({args.prompt_len}) + --output-len ({args.output_len}) exceeds "
            f"model_config.max_model_len ({model.max_model_len}); give shorter lengths, or "
            "a profile whose max_model_len holds them"
        )
    tokens = args.requests * (args.prompt_len + args.output_len)
    if tokens > MAX_WORKLOAD_TOKENS:
        raise ValueError(
            f"--requests ({args.requests}) x (--prompt-len + --output-len) is {tokens} tokens, "
            f"more than the {MAX_WORKLOAD_TOKENS} a run holds; give fewer requests or "
            "shorter lengths"
        )
    spec = WorkloadSpec(
        num_requests=args.requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        shared_prefix_ratio=args.shared_prefix_ratio,
        vocab_size=model.vocab_size,
        seed=args.seed,
    )
    return synthetic_workload(spec)


class _ProgressBar:
    """A one-line progress bar redrawn in place on a terminal, erased when closed.

    Only drawn on a terminal: in a log or a pipe, its lines would be noise
    around the report.
    """

    def __init__(self, stream: TextIO, total: int, width: int = 30) -> None:
        self._stream = stream
        self._total = max(total, 1)
        self._done = 0
        self._width = width

    def advance(self, label: str) -> None:
        self._done += 1
        filled = self._width * self._done // self._total
        bar = "#" * filled + "." * (self._width - filled)
        # \r back to the line's start, \x1b[K erases what a longer label left.
        self._stream.write(f"\r[{bar}] {self._done}/{self._total} requests ({label})\x1b[K")
        self._stream.flush()

    def close(self) -> None:
        self._stream.write("\r\x1b[K")
        self._stream.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvwire.run`: the same as `kvwire run` (its usage errors, its Ctrl-C)."""
    from kvwire.cli import main as kvwire_main

    return kvwire_main(["run", *(sys.argv[1:] if argv is None else argv)])
