"""Engines for the Redis tests: one tiny model, with and without the Redis connector."""

from __future__ import annotations

from typing import Any

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support import engines
from tests.support.engines import generate, tokens, with_connector

__all__ = [
    "distinct_full_blocks",
    "distinct_prompt_blocks",
    "generate",
    "generate_with_stats",
    "shared_prefix_workload",
    "tiny_config",
    "tokens",
    "with_redis",
]

BLOCK_SIZE = 4


def tiny_config() -> EngineConfig:
    """A model and cache small enough that a whole workload runs in about a second."""
    return engines.tiny_config(block_size=BLOCK_SIZE)


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
    redis_extra = {
        "url": url,
        "key_prefix": key_prefix,
        # Outage tests restart the server within milliseconds.
        "retry_interval_s": 0.001,
        "staging_buffer_bytes": "1MiB",
        **extra,
    }
    return with_connector(
        config, connector, redis_extra, kv_role=kv_role, policy=policy, module_path=module_path
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


def generate_with_stats(
    config: EngineConfig, requests: list[GenerationRequest]
) -> tuple[list[RequestOutput], dict[str, Any]]:
    """Run ``requests`` on a fresh engine; its outputs and the connector's stats of the run."""
    with LLMEngine(config) as engine:
        outputs = engine.generate(requests)
        return outputs, dict(engine.connector_stats.data)


def distinct_full_blocks(sequences: list[tuple[int, ...]], block_size: int) -> int:
    """How many different KV blocks the full blocks of the token ``sequences`` are.

    A block is identified by every token up to its end (block hashes chain),
    so a prefix common to several sequences counts once.
    """
    blocks = {
        sequence[:end]
        for sequence in sequences
        for end in range(block_size, len(sequence) + 1, block_size)
    }
    return len(blocks)


def distinct_prompt_blocks(requests: list[GenerationRequest], block_size: int) -> int:
    """How many different KV blocks an engine could load for the prompts of ``requests``.

    A prompt's last token is always computed, never loaded, so its full
    blocks are those before it.
    """
    return distinct_full_blocks([request.prompt_token_ids[:-1] for request in requests], block_size)
