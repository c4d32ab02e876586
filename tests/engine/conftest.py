"""Fixtures for the engine's tests: tiny configs, and engines with and without a connector."""

from __future__ import annotations

import pathlib
from typing import Any

import attrs
import pytest

from kvwire.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvwire.engine.engine import GenerationRequest
from kvwire.engine.workload import WorkloadSpec, synthetic_workload

DIRECTORY_CONNECTOR = "tests.engine.directory_connector"


def tiny_config(**cache: Any) -> EngineConfig:
    """A model and cache small enough that a whole workload runs in well under a second."""
    return EngineConfig(
        model_config=ModelConfig(num_layers=2, vocab_size=300, max_model_len=512),
        cache_config=CacheConfig(
            block_size=4, num_gpu_blocks=cache.pop("num_gpu_blocks", 128), **cache
        ),
    )


def with_directory_connector(
    config: EngineConfig, store_dir: pathlib.Path, policy: str = "recompute", **flags: bool
) -> EngineConfig:
    return attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="DirectoryConnector",
            kv_connector_module_path=DIRECTORY_CONNECTOR,
            kv_role="kv_both",
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
            kv_connector_extra_config={"store_dir": str(store_dir), **flags},
        ),
    )


@pytest.fixture
def config() -> EngineConfig:
    return tiny_config()


@pytest.fixture
def workload() -> list[GenerationRequest]:
    """Eight requests, most sharing a long prefix, with block-unaligned lengths."""
    spec = WorkloadSpec(
        num_requests=8, prompt_len=30, output_len=6, shared_prefix_ratio=0.6, vocab_size=300, seed=3
    )
    return synthetic_workload(spec)
