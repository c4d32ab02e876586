"""Disaggregated prefill between two vLLM engines: kvwire's peer medium against vLLM's own
NixlConnector, and both against computing the prompts, in one run.

Part of ``--only peer`` when vLLM is installed (``.venv-vllm/bin/python -m
benchmarks --only peer``). Per configuration, a prefill engine in a process of
its own computes long distinct prompts (one token each) and keeps their KV;
a fresh decode engine in another process is given the same prompts, one at
a time, and its time to first token is the wall time of that one-token
``generate()``. The bound is a decode engine with no connector (it computes
the prompts). Every engine first serves a short warm-up prompt (prefilled
too), so that the figures are those of engines whose connections are made.

- vLLM NixlConnector (``kv_buffer_device: cpu``): each request's
  ``kv_transfer_params`` go from the prefill engine's output to the decode
  request, as vLLM's router does; the decode engine pulls every prompt
  block, the last one's partial tokens too.
- kvwire peer (the shipped profiles ``peer-prefill`` and ``peer-decode``,
  through ``KVWireConnector``): no parameters pass; the decode engine finds
  the blocks by hash in the directory (a redis-server started here) and
  pulls every full prompt block with NIXL reads from the prefill engine's
  CPU pool, then computes the prompt's last block.

Both over the same UCX transport (``UCX_TLS``, default ``tcp,self,sm``).
vLLM's ``prompt_tokens_by_source`` gives, for every configuration, the
prompt tokens the decode engine computed and those it received; the tokens
are checked against no connector's. Same model (benchmarks.vllm's GQA Llama)
and prompts for all.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import yaml

from benchmarks.redis import redis_server
from benchmarks.vllm import GQA_SHAPE, VOCAB, build_model, engine_environment, start_llm

CONFIGURATIONS = ("no connector", "vLLM NixlConnector", "kvwire peer")
NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
# What a router sends the prefill engine: keep the KV for a remote decode.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
REPO = pathlib.Path(__file__).resolve().parents[1]
ENGINE_TIMEOUT_S = 1200


def require_nixl() -> None:
    """Stop, saying what to install, where vLLM's NixlConnector would find no NIXL."""
    if importlib.util.find_spec("nixl") is None:
        raise SystemExit(
            "vLLM's NixlConnector imports NIXL as `nixl`: make .venv-vllm/.nixl-installed "
            "(the nixl meta-package beside the peer extra's nixl-cu12)"
        )


def run_vllm(quick: bool) -> dict[str, Any]:
    """The decode engine's TTFT per configuration, and each against no connector's."""
    require_nixl()
    count, length = (2, 1024) if quick else (4, 2048)
    shape = GQA_SHAPE | ({"num_hidden_layers": 4} if quick else {})
    warm_up = [(position * 13) % (VOCAB - 3) + 3 for position in range(4 * 32 + 1)]
    prompts = [
        [(index * 7919 + position * 31) % (VOCAB - 3) + 3 for position in range(length)]
        for index in range(count)
    ]
    results: dict[str, dict[str, Any]] = {}
    with redis_server() as url, tempfile.TemporaryDirectory(prefix="kvwire-peer-vllm-") as scratch:
        root = pathlib.Path(scratch)
        model = build_model(root / "model", shape)
        prefix = f"kvwire-bench-peer-vllm:{uuid.uuid4().hex[:8]}:"
        for name in CONFIGURATIONS:
            print(f"  vLLM: {name} ...", flush=True)
            prefill_config, decode_config, params = _configurations(name, url, prefix)
            workdir = root / name.replace(" ", "-")
            workdir.mkdir()
            if prefill_config is None:
                decode_params: list[Any] = [None] * (count + 1)
                results[name] = _decode(
                    model, decode_config, [warm_up, *prompts], decode_params, workdir
                )
                continue
            with _prefill(model, prefill_config, [warm_up, *prompts], params, workdir) as produced:
                results[name] = _decode(
                    model, decode_config, [warm_up, *prompts], produced, workdir
                )
    return summarize(results, count, length, shape)


def _configurations(
    name: str, url: str, prefix: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
    """The prefill engine's and the decode engine's kv_transfer_config, and the prefill
    requests' kv_transfer_params."""
    if name == "no connector":
        return None, None, None
    if name == "vLLM NixlConnector":
        common = {**NIXL, "kv_load_failure_policy": "recompute"}
        return (
            {**common, "kv_role": "kv_producer"},
            {**common, "kv_role": "kv_consumer"},
            REMOTE_DECODE,
        )
    return (
        _kvwire(_peer_profile("peer-prefill", url, prefix)),
        _kvwire(_peer_profile("peer-decode", url, prefix)),
        None,
    )


def _peer_profile(name: str, url: str, prefix: str) -> dict[str, Any]:
    from kvwire.config.profile import shipped_profile_path

    profile: dict[str, Any] = yaml.safe_load(shipped_profile_path(name).read_text())
    options = profile["kv_transfer_config"]["kv_connector_extra_config"]
    options.update(url=url, key_prefix=prefix, cpu_pool_bytes="256MiB")
    return profile


def _kvwire(profile: dict[str, Any]) -> dict[str, Any]:
    transfer = profile["kv_transfer_config"]
    return {
        "kv_connector": "KVWireConnector",
        "kv_connector_module_path": "kvwire.vllm",
        "kv_role": transfer["kv_role"],
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvwire": profile},
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _environment(scratch: pathlib.Path) -> dict[str, str]:
    """An engine process's environment, with a NIXL side channel of its own on loopback."""
    return {
        "UCX_TLS": "tcp,self,sm",
        **engine_environment(scratch),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
    }


@contextlib.contextmanager
def _prefill(
    model: str,
    config: dict[str, Any],
    prompts: list[list[int]],
    params: dict[str, Any] | None,
    workdir: pathlib.Path,
) -> Iterator[list[Any]]:
    """A prefill engine that computed ``prompts`` and stays up; yields each output's
    kv_transfer_params."""
    job = workdir / "prefill.json"
    output, release = workdir / "prefill.out", workdir / "release"
    job.write_text(
        json.dumps(
            {
                "model": model,
                "kv_transfer_config": config,
                "kv_transfer_params": params,
                "prompts": prompts,
                "output": str(output),
                "release": str(release),
            }
        )
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.peer_vllm", "--prefill", str(job)],
        env=_environment(workdir),
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "prefill.log").open("w"),
    )
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not output.exists():
            if process.poll() is not None:
                log = (workdir / "prefill.log").read_text()[-4000:]
                raise RuntimeError(f"the prefill engine failed:\n{log}")
            if time.monotonic() > deadline:
                raise RuntimeError("the prefill engine never finished prefilling")
            time.sleep(0.2)
        produced: list[Any] = json.loads(output.read_text())
        yield produced
    finally:
        release.touch()
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def _decode(
    model: str,
    config: dict[str, Any] | None,
    prompts: list[list[int]],
    params: list[Any],
    workdir: pathlib.Path,
) -> dict[str, Any]:
    job = workdir / "decode.json"
    output = workdir / "decode.out"
    job.write_text(
        json.dumps(
            {
                "model": model,
                "kv_transfer_config": config,
                "prompts": prompts,
                "kv_transfer_params": params,
                "output": str(output),
            }
        )
    )
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_vllm", "--decode", str(job)],
        env=_environment(workdir),
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"the decode engine failed:\n{completed.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(output.read_text())
    return result


def prefill_engine(job_path: str) -> None:
    """The prefill process: one token of every prompt, saves settled, then held until released."""
    from vllm import SamplingParams

    from kvwire.vllm import wait_for_saves

    job = json.loads(pathlib.Path(job_path).read_text())
    llm = start_llm(job["model"], job["kv_transfer_config"])
    params = job["kv_transfer_params"]
    sampling = SamplingParams(
        max_tokens=1, temperature=0, extra_args={"kv_transfer_params": params} if params else None
    )
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in job["prompts"]], sampling, use_tqdm=False
    )
    if job["kv_transfer_config"]["kv_connector"] == "KVWireConnector":
        wait_for_saves(llm)  # a block is announced to peers once its save completed
    pathlib.Path(f"{job['output']}.tmp").write_text(
        json.dumps([output.kv_transfer_params for output in outputs])
    )
    os.replace(f"{job['output']}.tmp", job["output"])
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    while not os.path.exists(job["release"]) and time.monotonic() < deadline:
        time.sleep(0.05)


def decode_engine(job_path: str) -> None:
    """The decode process: each prompt alone, one token, timed; vLLM's and kvwire's counts."""
    from vllm import SamplingParams

    from kvwire.vllm import kvwire_stats

    job = json.loads(pathlib.Path(job_path).read_text())
    config = job["kv_transfer_config"]
    llm = start_llm(job["model"], config, disable_log_stats=False)
    measured: dict[str, list[Any]] = {"seconds": [], "tokens": []}
    before: dict[str, float] = {}
    for index, (prompt, params) in enumerate(
        zip(job["prompts"], job["kv_transfer_params"], strict=True)
    ):
        if index == 1:  # the warm-up prompt's counts left out
            before = _prompt_tokens_by_source(llm)
        sampling = SamplingParams(
            max_tokens=1,
            temperature=0,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        started = time.perf_counter()
        (output,) = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
        if index:
            measured["seconds"].append(time.perf_counter() - started)
            measured["tokens"].append(list(output.outputs[0].token_ids))
    after = _prompt_tokens_by_source(llm)
    uses_kvwire = config is not None and config["kv_connector"] == "KVWireConnector"
    pathlib.Path(job["output"]).write_text(
        json.dumps(
            {
                **measured,
                "prompt_tokens_by_source": {
                    source: after[source] - before.get(source, 0.0) for source in after
                },
                "kvwire_stats": kvwire_stats(llm) if uses_kvwire else {},
            }
        )
    )


def _prompt_tokens_by_source(llm: Any) -> dict[str, float]:
    return {
        metric.labels["source"]: float(metric.value)
        for metric in llm.get_metrics()
        if metric.name == "vllm:prompt_tokens_by_source"
    }


def summarize(
    results: dict[str, dict[str, Any]], count: int, length: int, shape: dict[str, int]
) -> dict[str, Any]:
    """The table: per configuration, its p50 TTFT over no connector's and what it computed."""
    expected = results["no connector"]["tokens"]
    configurations: dict[str, Any] = {}
    for name, result in results.items():
        by_source = result["prompt_tokens_by_source"]
        stats = result["kvwire_stats"]
        configurations[name] = {
            "ttft_p50_s": statistics.median(result["seconds"]),
            "ttft_mean_s": statistics.fmean(result["seconds"]),
            "prompt_tokens_computed": by_source.get("local_compute", 0.0),
            "prompt_tokens_received": by_source.get("external_kv_transfer", 0.0),
            "tokens_equal_no_connector": result["tokens"] == expected,
            **({"kvwire_peer_blocks_pulled": stats.get("peer_blocks_pulled", 0)} if stats else {}),
            **({"kvwire_load_errors": stats.get("load_errors", 0)} if stats else {}),
        }
    bound = configurations["no connector"]["ttft_p50_s"]
    for entry in configurations.values():
        entry["ttft_over_no_connector"] = entry["ttft_p50_s"] / bound
    nixl = configurations["vLLM NixlConnector"]["ttft_p50_s"]
    return {
        "prompts": count,
        "prompt_tokens": length,
        "model": shape,
        "ucx_tls": os.environ.get("UCX_TLS", "tcp,self,sm"),
        "configurations": configurations,
        "peer_ttft_over_nixl": configurations["kvwire peer"]["ttft_p50_s"] / nixl,
    }


if __name__ == "__main__":  # the engine processes
    role, job_file = sys.argv[1:3]
    {"--prefill": prefill_engine, "--decode": decode_engine}[role](job_file)
