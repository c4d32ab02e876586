"""Engines for the Redis tests: one tiny model, with and without the Redis connector."""

from __future__ import annotations

from typing import Any

import attrs

from kvwire.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import WorkloadSpec, synthetic_workload

BLOCK_SIZE = 4


def tiny_config() -> EngineConfig:
    """A model and cache small enough that a whole workload runs in about a second."""
    return EngineConfig(
        model_config=ModelConfig(num_layers=2, vocab_size=300, max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=128),
    )


def with_redis(
    config: EngineConfig,
    url: str,
    key_prefix: str,
    *,
    kv_role: str = "kv_both",
    policy: str = "recompute",
    connector: str = "RedisConnector",
    module_path: str | None = None,
    **extra: Any,
) -> EngineConfig:
    """``config`` with a Redis connector at ``url``; ``extra`` adds extra-config keys."""
    return attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module_path,
            kv_role=kv_role,  # type: ignore[arg-type]
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
            kv_connector_extra_config={
                "url": url,
                "key_prefix": key_prefix,
                # Outage tests restart the server within milliseconds.
                "retry_interval_s": 0.001,
                "staging_buffer_bytes": "1MiB",
                **extra,
            },
        ),
    )


def shared_prefix_workload(
    seed: int = 3, num_requests: int = 6, shared_prefix_ratio: float = 0.7
) -> list[GenerationRequest]:
    """Prompts sharing most of a long prefix, with block-unaligned lengths."""
    spec = WorkloadSpec(
        num_requests=num_requests,
        prompt_len=30,
        output_len=5,
        shared_prefix_ratio=shared_prefix_ratio,
        vocab_size=300,
        seed=seed,
    )
    return synthetic_workload(spec)


def generate(config: EngineConfig, requests: list[GenerationRequest]) -> list[RequestOutput]:
    """Run ``requests`` on a fresh engine (its own empty local cache), then shut it down."""
    with LLMEngine(config) as engine:
        return engine.generate(requests)


def tokens(outputs: list[RequestOutput]) -> list[tuple[int, ...]]:
    return [output.output_token_ids for output in outputs]
