"""The table `kvwire run` prints: one column per pass, one row per figure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvwire.common.redaction import shown_key
from kvwire.run.passes import PASSES


def _count(value: Any) -> str:
    return "-" if value is None else f"{value:,}"


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _bytes(value: Any) -> str:
    if value is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _rate(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _times(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


_ROWS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("requests", "requests", _count),
    ("prompt tokens", "prompt_tokens", _count),
    ("tokens from local cache", "tokens_from_local_cache", _count),
    ("tokens from connector", "tokens_from_connector", _count),
    ("hit rate", "hit_rate", lambda value: f"{value:.1%}"),
    ("TTFT p50", "ttft_p50_ms", _ms),
    ("TTFT p95", "ttft_p95_ms", _ms),
    ("total time", "total_s", _seconds),
    ("bytes saved", "bytes_saved", _bytes),
    ("bytes loaded", "bytes_loaded", _bytes),
    ("transfer time", "transfer_s", _seconds),
    ("effective GB/s", "effective_gb_per_s", _rate),
    ("speed-up (total)", "speedup", _times),
    ("speed-up (TTFT p50)", "ttft_p50_speedup", _times),
    ("TTFT p50 / local", "ttft_p50_vs_local", _times),
    ("failed requests", "failed_requests", _count),
    ("outputs identical", "outputs_identical", lambda value: "yes" if value else "NO"),
)


# Counter names come from the connector's stats: a plug-in's may be many.
_LISTED_FAILURES = 6


def _failures(counters: dict[str, int]) -> str:
    """`save_errors 56, redis_saves_dropped 56`, the largest first, cut short."""
    ranked = sorted(counters.items(), key=lambda item: -item[1])
    text = ", ".join(f"{shown_key(name)} {count:,}" for name, count in ranked[:_LISTED_FAILURES])
    if len(ranked) > _LISTED_FAILURES:
        text += f" and {len(ranked) - _LISTED_FAILURES} more failure counters"
    return text


def _workers(report: dict[str, Any]) -> str:
    parallel = report["parallel"]
    processes = int(parallel["worker_processes"])
    if processes <= 1:
        return f"{report['worker_mode']} worker"
    return (
        f"{processes} worker processes: tensor_parallel_size "
        f"{parallel['tensor_parallel_size']} x pipeline_parallel_size "
        f"{parallel['pipeline_parallel_size']}"
    )


def _what_it_bought(report: dict[str, Any]) -> str:
    """One sentence in plain words: the warm pass against no connector, and the outputs."""
    none, warm = report["passes"]["no connector"], report["passes"]["warm"]
    speedup = warm["speedup"]
    took = f"took {warm['total_s']:.3f} s"
    if speedup is None:
        pace = f"{took} against {none['total_s']:.3f} s with no connector"
    else:
        faster = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
        pace = f"{took}, {faster} than the {none['total_s']:.3f} s with no connector"
    return (
        f"With {report['connector']} the warm pass {pace}; "
        f"{warm['tokens_from_connector']:,} of its {warm['prompt_tokens']:,} prompt tokens "
        "were loaded instead of computed, and every output was identical to the "
        "no-connector pass."
    )


def format_table(report: dict[str, Any]) -> str:
    """The report as an aligned text table, with a one-line verdict under it."""
    passes = report["passes"]
    header = ["", *PASSES]
    rows = [header] + [
        [label, *(render(passes[name][key]) for name in PASSES)] for label, key, render in _ROWS
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if column == 0 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    title = f"kvwire run: {report['connector']} ({_workers(report)})"
    hma = report["hma"]
    groups = hma["kv_cache_groups"]
    hma_line = (
        f"HMA {'on' if hma['enabled'] else 'off'}: {hma['reason']}; "
        f"{groups} KV cache group{'' if groups == 1 else 's'}"
    )
    # The figure a connector is judged by, under the table where it is easy to find.
    warm_vs_local = report["warm_vs_local_ttft_p50"]
    ratio_line = (
        "warm / local TTFT p50: -"
        if warm_vs_local is None
        else f"warm / local TTFT p50: {warm_vs_local:.2f} (1.00 = as fast as the engine's own "
        "prefix cache)"
    )
    nothing_connected = report.get("nothing_connected")
    if nothing_connected:
        verdict = (
            "FAILED: nothing connected: the connector stored and loaded nothing and reported "
            f"{_failures(nothing_connected)}; is its medium reachable (see the warnings above)?"
        )
    elif report["ok"]:
        verdict = _what_it_bought(report)
    else:
        verdict = "FAILED: outputs differ from the no-connector pass, or requests failed"
    return "\n".join([title, hma_line, "", *lines, "", ratio_line, verdict])
