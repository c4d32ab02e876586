"""Engines for tests: a tiny model, connectors configured on it, workloads, and their outputs."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import attrs

from kvwire.config import (
    CacheConfig,
    EngineConfig,
    KVRole,
    KVTransferConfig,
    LoadFailurePolicy,
    ModelConfig,
)
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import WorkloadSpec, synthetic_workload

DIRECTORY_CONNECTOR = "tests.support.directory_connector"


def tiny_config(**cache: Any) -> EngineConfig:
    """A model small enough that a workload runs in well under a second."""
    return EngineConfig(
        model_config=ModelConfig(num_layers=2, vocab_size=300, max_model_len=512),
        cache_config=CacheConfig(**{"block_size": 4, "num_gpu_blocks": 128, **cache}),
    )


def with_connector(
    config: EngineConfig,
    connector: str,
    extra: dict[str, Any],
    *,
    kv_role: KVRole = "kv_both",
    policy: LoadFailurePolicy = "recompute",
    module_path: str | None = None,
) -> EngineConfig:
    """``config`` naming ``connector`` (found in ``module_path`` if given) with ``extra``."""
    return attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module_path,
            kv_role=kv_role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config=extra,
        ),
    )


def with_directory_connector(
    config: EngineConfig,
    store_dir: pathlib.Path,
    policy: LoadFailurePolicy = "recompute",
    **flags: bool,
) -> EngineConfig:
    """``config`` with the test suite's own directory connector (no kvwire medium under it)."""
    return with_connector(
        config,
        "DirectoryConnector",
        {"store_dir": str(store_dir), **flags},
        policy=policy,
        module_path=DIRECTORY_CONNECTOR,
    )


def shared_storage(config: EngineConfig, directory: pathlib.Path, **extra: Any) -> EngineConfig:
    return with_connector(
        config,
        "SharedStorageConnector",
        {"shared_storage_path": str(directory), "staging_buffer_bytes": "4MiB", **extra},
    )


def tiered_disk(config: EngineConfig, directory: pathlib.Path) -> EngineConfig:
    """``config`` with the tiered profile: a CPU pool in front of shared storage."""
    children = [
        {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_extra_config": {"cpu_pool_bytes": "8MiB"},
        },
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(directory)},
        },
    ]
    return with_connector(config, "MultiConnector", {"connectors": children})


def workload(seed: int = 3, num_requests: int = 8, prompt_len: int = 30) -> list[GenerationRequest]:
    """Requests that mostly share a long prefix, with block-unaligned lengths."""
    spec = WorkloadSpec(
        num_requests=num_requests,
        prompt_len=prompt_len,
        output_len=6,
        shared_prefix_ratio=0.6,
        vocab_size=300,
        seed=seed,
    )
    return synthetic_workload(spec)


def renamed(requests: Sequence[GenerationRequest], suffix: str) -> list[GenerationRequest]:
    return [attrs.evolve(r, request_id=r.request_id + suffix) for r in requests]


def generate(
    config: EngineConfig, requests: Sequence[GenerationRequest], **options: Any
) -> list[RequestOutput]:
    """Run ``requests`` on a fresh engine and close it."""
    with LLMEngine(config, **options) as engine:
        return engine.generate(requests)


def tokens(outputs: Sequence[RequestOutput]) -> list[tuple[int, ...]]:
    return [output.output_token_ids for output in outputs]


def served(outputs: Sequence[RequestOutput]) -> int:
    """The prompt tokens the connector served, over all outputs."""
    return sum(output.external_tokens for output in outputs)
