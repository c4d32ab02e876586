"""Engines for the peer medium's tests: the tiny model, the peer medium's config, a workload."""

from __future__ import annotations

from typing import Any

import attrs

from kvwire.config import EngineConfig, KVRole, ParallelConfig
from kvwire.engine.engine import GenerationRequest
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.engines import tiny_config, with_connector

BLOCK_SIZE = 4


def peer_config(
    url: str,
    key_prefix: str,
    *,
    kv_role: KVRole = "kv_both",
    peer_name: str | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    **extra: Any,
) -> EngineConfig:
    """The tiny engine with the peer medium, its directory at ``url`` under ``key_prefix``.

    Split over ``tensor_parallel_size`` x ``pipeline_parallel_size`` worker
    processes when either is above 1 (the tiny model has two KV heads and
    two layers: one of each a rank at size 2).
    """
    options: dict[str, Any] = {
        "medium": "peer",
        "url": url,
        "key_prefix": key_prefix,
        "cpu_pool_bytes": "4MiB",
        "staging_blocks": 8,
        "transfer_timeout_s": 5,
        "peer_heartbeat_s": 1,
        **extra,
    }
    if peer_name is not None:
        options["peer_name"] = peer_name
    config = with_connector(
        tiny_config(block_size=BLOCK_SIZE), "OffloadConnector", options, kv_role=kv_role
    )
    if tensor_parallel_size == pipeline_parallel_size == 1:
        return config
    parallel = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size
    )
    return attrs.evolve(config, parallel_config=parallel)


def prompts(seed: int, num_requests: int = 4, prompt_len: int = 30) -> list[GenerationRequest]:
    """Requests sharing most of a prefix of their ``seed``'s, block-unaligned; ids name the seed."""
    spec = WorkloadSpec(
        num_requests=num_requests,
        prompt_len=prompt_len,
        output_len=5,
        shared_prefix_ratio=0.7,
        vocab_size=300,
        seed=seed,
    )
    return [
        attrs.evolve(request, request_id=f"seed{seed}-{request.request_id}")
        for request in synthetic_workload(spec)
    ]
