"""Disaggregated prefill through the peer medium, Redis and shared storage, in one run.

A prefill engine (``kv_producer``) computes long distinct prompts and keeps
their KV; a fresh decode engine (``kv_consumer``) is given the same prompts
and loads every full prompt block. Per medium: the decode engine's mean time
to first token and the bytes per second its loads moved (``bytes_loaded``
over the loads' wall time, ``load_seconds`` summed over the load threads,
divided by the threads). The bound is the same decode engine with no
connector (it computes the prompts). Each decode engine first serves a
short warm-up prompt (from the prefill engine too), so that the figures
are those of an engine whose connections are made. Same model, prompts
and machine for all, in this order, best of ``REPEATS`` decode passes each.

Both engines run in this process: the peer medium's two NIXL agents are
still two agents, connected through UCX as two processes would be
(``UCX_TLS``, default here ``tcp,self,sm``: loopback TCP and shared
memory); the directory and Redis run on one redis-server started here;
shared storage is a temporary directory. vLLM's NixlConnector needs vLLM
engines and a router passing its transfer parameters: where vLLM is
installed, :mod:`benchmarks.peer_vllm` then compares it with the peer medium
between two vLLM engines in the same run (``results["vllm"]``).
``python -m benchmarks.peer [--quick]`` or ``python -m benchmarks --only
peer`` (``.venv-vllm/bin/python`` for the comparison with NixlConnector);
writes ``peer.json``.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import statistics
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from benchmarks.common import MIB, write_json
from benchmarks.common import main as run_from_command_line
from benchmarks.redis import redis_server
from kvwire.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, ModelConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput

# One token of every layer: 4 layers x (keys + values) x 8 heads x 64 x fp32 = 16 KiB;
# one block of 16 tokens, 256 KiB.
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_TOKENS = 4, 8, 64, 16
REPEATS = 2
IO_THREADS = 2


def _config(kv_role: KVRole, connector: str, extra: dict[str, Any]) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(
            num_layers=NUM_LAYERS,
            num_attention_heads=NUM_KV_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            max_model_len=4096,
        ),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, num_gpu_blocks=1024),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_role=kv_role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"io_threads": IO_THREADS, **extra},
        ),
    )


def _prompts(count: int, length: int, repeat: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{repeat}-{index}",
            tuple((index * 131 + position * 7 + repeat) % 509 + 3 for position in range(length)),
            2,
        )
        for index in range(count)
    ]


def _media(url: str, storage: pathlib.Path) -> dict[str, Callable[[KVRole], EngineConfig]]:
    prefix = f"kvwire-bench-peer:{uuid.uuid4().hex[:8]}:"
    return {
        "peer": lambda role: _config(
            role,
            "OffloadConnector",
            {
                "medium": "peer",
                "url": url,
                "key_prefix": prefix,
                "cpu_pool_bytes": "512MiB",
                "peer_name": f"bench-{role}",
            },
        ),
        "redis": lambda role: _config(
            role,
            "RedisConnector",
            {"url": url, "key_prefix": prefix, "max_save_bytes_in_flight": "64MiB"},
        ),
        "shared_storage": lambda role: _config(
            role,
            "SharedStorageConnector",
            {"shared_storage_path": str(storage), "max_save_bytes_in_flight": "64MiB"},
        ),
    }


def _mean_ttft(outputs: list[RequestOutput]) -> float:
    return statistics.fmean(o.time_to_first_token_s or 0.0 for o in outputs)


def _decode(
    config: EngineConfig, warm_up: list[GenerationRequest], prompts: list[GenerationRequest]
) -> dict[str, float]:
    """A decode engine's figures for ``prompts``, after ``warm_up`` (connections made, as in
    a decode engine that has served before)."""
    with LLMEngine(config) as engine:
        engine.generate(warm_up)
        before = dict(engine.connector_stats.data)
        outputs = engine.generate(prompts)
        after = dict(engine.connector_stats.data)
    stats = {name: value - before.get(name, 0.0) for name, value in after.items()}
    loaded = stats.get("bytes_loaded", 0.0)
    wall = stats.get("load_seconds", 0.0) / IO_THREADS
    return {
        "ttft_s": _mean_ttft(outputs),
        "bytes_loaded": loaded,
        "load_gbps": loaded / wall / 1e9 if wall else 0.0,
        "load_errors": stats.get("load_errors", 0.0),
        "external_tokens": float(sum(o.external_tokens for o in outputs)),
    }


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    with_vllm = importlib.util.find_spec("vllm") is not None
    if with_vllm:
        from benchmarks.peer_vllm import require_nixl

        require_nixl()  # before the first part's minutes, not after
    count, length = (2, 512) if quick else (4, 1024)
    results: dict[str, Any] = {
        "prompts": count,
        "prompt_tokens": length,
        "block_bytes": NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_SIZE * 4 * BLOCK_TOKENS,
        "ucx_tls": os.environ["UCX_TLS"],
        "media": {},
    }
    with redis_server() as url, tempfile.TemporaryDirectory() as storage:
        media = _media(url, pathlib.Path(storage))
        bound = _config("kv_consumer", "OffloadConnector", {})
        best: dict[str, dict[str, float]] = {}
        for repeat in range(1 if quick else REPEATS):
            prompts = _prompts(count, length, repeat)
            warm_up = _prompts(1, BLOCK_TOKENS * 4 + 1, 1000 + repeat)
            decode = [attrs.evolve(p, request_id=f"{p.request_id}/d") for p in prompts]
            runs = {
                "no_connector": _decode(
                    attrs.evolve(bound, kv_transfer_config=None), warm_up, prompts
                )
            }
            for name, config_for in media.items():
                # The prefill engine stays up while the decode engine reads its memory.
                with LLMEngine(config_for("kv_producer")) as prefill:
                    prefill.generate([attrs.evolve(p, max_tokens=1) for p in warm_up + prompts])
                    prefill.wait_for_saves()
                    runs[name] = _decode(config_for("kv_consumer"), warm_up, decode)
            for name, measured in runs.items():
                if name not in best or measured["ttft_s"] < best[name]["ttft_s"]:
                    best[name] = measured
        results["media"] = best
    computed = best["no_connector"]["ttft_s"]
    results["ttft_over_no_connector"] = {
        name: measured["ttft_s"] / computed for name, measured in best.items()
    }
    redis_gbps = best["redis"]["load_gbps"]
    results["peer_load_gbps_over_redis"] = best["peer"]["load_gbps"] / redis_gbps
    results["prompt_mib"] = count * length * results["block_bytes"] / BLOCK_TOKENS / MIB
    summary: dict[str, Any] = {
        "ttft_over_no_connector": {
            name: round(ratio, 3) for name, ratio in results["ttft_over_no_connector"].items()
        },
        "load_gbps": {
            name: round(measured["load_gbps"], 3)
            for name, measured in best.items()
            if name != "no_connector"
        },
        "peer_load_gbps_over_redis": round(results["peer_load_gbps_over_redis"], 3),
    }
    if not with_vllm:
        summary["vllm"] = "not run: needs vLLM (.venv-vllm/bin/python -m benchmarks --only peer)"
    else:
        from benchmarks.peer_vllm import run_vllm

        results["vllm"] = vllm = run_vllm(quick)
        summary["vllm"] = {
            "ttft_over_no_connector": {
                name: round(measured["ttft_over_no_connector"], 3)
                for name, measured in vllm["configurations"].items()
            },
            "peer_ttft_over_nixl": round(vllm["peer_ttft_over_nixl"], 3),
        }
    write_json(output_dir, "peer.json", results)
    return summary


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line("python -m benchmarks.peer", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
