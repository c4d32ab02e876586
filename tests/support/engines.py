"""Engines for tests: a tiny model, full-attention or hybrid, and what runs on it.

Connectors configured on it, workloads and their outputs, and connectors for
the HMA gate.
"""

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
    SchedulerConfig,
)
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.presets import MODEL_PRESETS
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from kvwire.interface.base import KVConnectorMetadata, SupportsHMA
from kvwire.interface.types import KVCacheBlocks, Request, SchedulerOutput
from kvwire.testing import IdleConnector

# Engines for tests: a tiny model, connectors configured on it, workloads, and their outputs.

DIRECTORY_CONNECTOR = "tests.support.directory_connectors"


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
        {"shared_storage_path": str(directory), "max_save_bytes_in_flight": "4MiB", **extra},
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


# Tiny hybrid engine configs for the hybrid tests, and connectors for the HMA gate.

BLOCK_SIZE = 4


def tiny_hybrid_config(
    *,
    num_gpu_blocks: int = 128,
    enable_prefix_caching: bool = True,
    disable_hybrid_kv_cache_manager: bool | None = None,
    max_num_batched_tokens: int = 512,
) -> EngineConfig:
    """The tiny-hybrid preset (layers sliding, full, sliding, full; window 8) on blocks of 4."""
    model = attrs.evolve(MODEL_PRESETS["tiny-hybrid"], vocab_size=300, max_model_len=512)
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
        scheduler_config=SchedulerConfig(
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
    )


def with_connector_class(config: EngineConfig, connector: type) -> EngineConfig:
    """``config`` naming ``connector`` (a class importable from its module)."""
    return attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector.__name__,
            kv_connector_module_path=connector.__module__,
            kv_role="kv_both",
        ),
    )


class PlainConnector(IdleConnector):
    """A connector without SupportsHMA: the HMA gate turns HMA off for it."""


class RecordingHMAConnector(IdleConnector, SupportsHMA):
    """An HMA connector that loads and saves nothing and records the block ids it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allocated: list[tuple[str, tuple[list[int], ...]]] = []
        self.scheduled: list[tuple[str, tuple[list[int], ...]]] = []
        self.finished: list[tuple[str, tuple[list[int], ...]]] = []

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.allocated.append((request.request_id, blocks.get_block_ids()))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for item in scheduler_output.scheduled:
            self.scheduled.append((item.request_id, item.block_ids))
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append((request.request_id, block_ids))
        return False, None
