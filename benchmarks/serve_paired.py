"""Two serving configurations on one trace, request by request: what a difference of a few
percent between them is, on a host whose speed moves more than that.

``.venv-vllm/bin/python -m benchmarks.serve_paired tiered shared-storage [--quick]
[--passes N]``: the two configurations are :mod:`benchmarks.serve_tiers`' of those
kinds (each kind's ``--quick`` one; the same kind twice measures the method's own
noise), or named by their labels (``Configuration.label``:
``tiered-kvfifo-spill-promotion-never``). Each pass starts a server of each,
fresh, over empty stores, both at once (the first of them first in even
passes, the second in odd ones),
and sends every request of ``serve-tiers``' trace to one and then the other, one
request in flight at a time, the first of the two alternating (A B, B A, A B, ...),
so that both meet the host in the same state to within a request. The rounds of
``serve-tiers`` instead give each configuration the host for a minute or more, and
on a shared host that moves a configuration's throughput by up to 20% from one
round to the next, more than configurations differ.

Both servers idle while the other serves (the share of the host they keep busy
so, before each pass's first request, is measured and reported). What a server
does after its answer (its saves) runs while the next request is served, by
either server as the order alternates: half of it lands on the other's times, so
the figures understate a difference in such work by half. Each request's time is from sending it
to its whole answer (two tokens, greedy); a server's throughput is its requests
over the sum of its requests' times. Per pass: each configuration's req/s, the
first's req/s over the second's (the second's time over the first's) on the whole
trace and on each half of it, the outputs the two give alike, and each
server's prompt tokens computed and counters (``/metrics``, over the pass). Writes
``serve-paired-FIRST-SECOND.json`` and ``.md`` (the two names) to ``--output-dir``,
``benchmarks/results`` by default.

The client here is a plain HTTP one, not vLLM's: vLLM's sends a dataset to one
server, and the pairing needs each request sent to two.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pathlib
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import attrs

from benchmarks import serve_tiers
from benchmarks.common import write_json
from benchmarks.rounds import positive_int, spread, spread_cell
from benchmarks.serve import difference, scrape, vllm_servers

NAME = "serve-paired"
PAIRED_KINDS = tuple(kind for kind in serve_tiers.KINDS if kind != "example")
# Every configuration a pass can run, by label: a kind's quick one has its kind's too.
CONFIGURATIONS = (
    *serve_tiers.CONFIGURATIONS,
    *serve_tiers.REDIS_CONFIGURATIONS,
    *serve_tiers.COLD_DISK_CONFIGURATIONS,
    *serve_tiers.LIMIT_CACHE_CONFIGURATIONS,
)
PAIRED_LABELS = tuple(
    config.label
    for config in CONFIGURATIONS
    if config.kind in (*PAIRED_KINDS, "redis")
    and serve_tiers.BEST not in (config.eviction, config.write_policy)
)
PAIRED_NAMES = tuple(dict.fromkeys((*PAIRED_KINDS, *PAIRED_LABELS)))
DEFAULT_PASSES = 3
# A request of the quick trace takes about 0.1 s; one stalled this long is a broken server.
REQUEST_TIMEOUT_S = 60.0
# The servers idle while the other serves: above this share of the host kept busy by
# both idle, a pass's figures would carry one server's work in the other's times.
IDLE_BUSY_WARNING = 0.1


def configuration(name: str) -> serve_tiers.Configuration:
    """``serve-tiers``' quick configuration of kind ``name``, or its configuration so labelled."""
    for config in serve_tiers.CONFIGURATIONS:
        if config.kind == name and config.quick:
            return config
    for config in CONFIGURATIONS:
        if config.label == name and name in PAIRED_LABELS:
            return config
    raise ValueError(
        f"{name!r} is not a kind nor a configuration's label: expected one of {PAIRED_NAMES}"
    )


def flush_redis(url: str) -> None:
    """Drop every entry of the benchmark's own Redis server."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def order(request_index: int) -> tuple[int, int]:
    """Which server gets a request first: the first, then the second, alternating."""
    return (0, 1) if request_index % 2 == 0 else (1, 0)


def start_order(pass_index: int) -> tuple[int, int]:
    """Which server starts first: the first in even passes, the second in odd ones.

    Whatever starting first does to a server (where the system places its
    threads and its memory) then falls on both configurations alike.
    """
    return order(pass_index)


def pass_figures(
    seconds: Sequence[Sequence[float]], texts: Sequence[Sequence[str]]
) -> dict[str, Any]:
    """One pass: each server's req/s, the first's over the second's (whole trace, each half),
    and the outputs equal between them."""
    first, second = seconds
    half = len(first) // 2
    return {
        "request_throughput": [round(len(times) / sum(times), 3) for times in seconds],
        "first_over_second": round(sum(second) / sum(first), 3),
        "first_over_second_by_half": [
            round(sum(second[:half]) / sum(first[:half]), 3),
            round(sum(second[half:]) / sum(first[half:]), 3),
        ],
        "outputs_equal": sum(a == b for a, b in zip(*texts, strict=True)),
    }


def host_busy_share(seconds: float) -> float:
    """The share of the host's CPU time that was not idle over the next ``seconds``."""

    def times() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(field) for field in stat.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # idle and iowait

    total_before, idle_before = times()
    time.sleep(seconds)
    total_after, idle_after = times()
    return round(1 - (idle_after - idle_before) / max(1, total_after - total_before), 3)


def complete(url: str, model: str, prompt: str, output_len: int) -> tuple[float, str]:
    """One greedy completion: the seconds from sending it to its whole answer, and its text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        answer = json.loads(response.read())
    text: str = answer["choices"][0]["text"]
    return time.perf_counter() - started, text


def run(output_dir: pathlib.Path, names: Sequence[str], quick: bool, passes: int) -> dict[str, Any]:
    """The two configurations (kinds or labels) side by side, ``passes`` times; writes results."""
    configs = [configuration(name) for name in names]
    workload = serve_tiers.QUICK if quick else serve_tiers.FULL
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            f"the {NAME} benchmark runs in the vLLM venv: "
            ".venv-vllm/bin/python -m benchmarks.serve_paired FIRST SECOND"
        )
    from benchmarks.vllm import build_model

    started = time.monotonic()
    _, tokens, sizes = serve_tiers.served_trace(workload)
    prompts = [serve_tiers.prompt_text(prompt) for prompt in tokens]
    output_dir.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"kvwire-bench-{NAME}-", dir=output_dir))
    results = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        redis_url = None
        if any(serve_tiers.needs_redis(config) for config in configs):
            from benchmarks.redis import redis_server

            redis_url = stack.enter_context(redis_server())
        model = build_model(scratch / "model", serve_tiers.SHAPE)
        for number in range(passes):
            print(f"  pass {number + 1} of {passes}", flush=True)
            specs = []
            starting = start_order(number)
            for side in starting:
                stores = pathlib.Path(tempfile.mkdtemp(prefix="stores-", dir=scratch))
                config = configs[side]
                transfer = serve_tiers.transfer_config(
                    config, stores, workload.primary_blocks, redis_url
                )
                log = scratch / f"server-{number}-{side}.log"
                specs.append(serve_tiers.server_spec(model, config, sizes, transfer, log))
            with vllm_servers(specs) as started_urls:
                urls = [started_urls[starting.index(side)] for side in (0, 1)]
                idle = host_busy_share(3.0)
                before = [scrape(url) for url in urls]
                if idle > IDLE_BUSY_WARNING:
                    print(f"    the idle servers kept {idle:.0%} of the host busy", flush=True)
                seconds: list[list[float]] = [[], []]
                texts: list[list[str]] = [[], []]
                for index, prompt in enumerate(prompts):
                    for side in order(index):
                        took, text = complete(urls[side], model, prompt, workload.output_len)
                        seconds[side].append(took)
                        texts[side].append(text)
                counters = [difference(b, scrape(url)) for b, url in zip(before, urls, strict=True)]
            figures = {
                **pass_figures(seconds, texts),
                "idle_busy_share": idle,
                "computed_prompt_tokens": [
                    round(server.get("prompt_tokens_local_compute", 0)) for server in counters
                ],
                "server_counters": counters,
            }
            rates, ratio = figures["request_throughput"], figures["first_over_second"]
            print(f"    req/s {rates}, first over second {ratio}", flush=True)
            results.append(figures)
            if redis_url is not None:
                flush_redis(redis_url)  # each pass starts over empty stores
    summary = {
        "configurations": [config.name for config in configs],
        "workload": attrs.asdict(workload),
        "passes": results,
        "first_over_second": spread([result["first_over_second"] for result in results]),
        "seconds": round(time.monotonic() - started),
    }
    stem = result_stem(names, quick)
    write_json(output_dir, f"{stem}.json", summary)
    (output_dir / f"{stem}.md").write_text(table(summary))
    return summary


def result_stem(names: Sequence[str], quick: bool) -> str:
    """The results' file name without its suffix: the pair's names, and ``full`` for the
    600-request trace, so that a full run of a pair never replaces its quick run."""
    return "-".join((NAME, *(() if quick else ("full",)), *names))


def table(summary: dict[str, Any]) -> str:
    """One row a pass, and the median over the passes with its range."""
    first, second = summary["configurations"]
    lines = [
        f"{first} (first) against {second} (second), every request to both in turn; "
        f"{summary['workload']['trace']['requests']} requests a pass.",
        "",
        "| pass | req/s: first / second | first over second | by half of the trace "
        "| outputs alike | prompt tokens computed: first / second "
        "| idle servers' share of the host |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, result in enumerate(summary["passes"], 1):
        rates = " / ".join(f"{rate:.2f}" for rate in result["request_throughput"])
        halves = ", ".join(f"{value:.3f}" for value in result["first_over_second_by_half"])
        computed = " / ".join(f"{tokens:,}" for tokens in result["computed_prompt_tokens"])
        lines.append(
            f"| {number} | {rates} | {result['first_over_second']:.3f} | {halves} "
            f"| {result['outputs_equal']} | {computed} | {result['idle_busy_share']:.3f} |"
        )
    median = spread_cell(summary["first_over_second"], ".3f")
    lines.append(f"| median (range) | | {median} | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.serve_paired FIRST SECOND [--quick] [--passes N]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_paired")
    parser.add_argument(
        "names",
        nargs=2,
        choices=PAIRED_NAMES,
        metavar="CONFIGURATION",
        help="a kind (its quick configuration) or a configuration's label: "
        + ", ".join(PAIRED_NAMES),
    )
    parser.add_argument("--quick", action="store_true", help="the 100-request trace")
    parser.add_argument("--passes", type=positive_int, default=DEFAULT_PASSES)
    parser.add_argument(
        "--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks/results")
    )
    args = parser.parse_args(argv)
    summary = run(args.output_dir, args.names, args.quick, args.passes)
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
