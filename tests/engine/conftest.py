"""Fixtures for the engine's tests: a tiny config and a workload that shares prefixes."""

from __future__ import annotations

import pytest

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest
from tests.support.engines import tiny_config
from tests.support.engines import workload as shared_prefix_workload


@pytest.fixture
def config() -> EngineConfig:
    return tiny_config()


@pytest.fixture
def workload() -> list[GenerationRequest]:
    """Eight requests, most sharing a long prefix, with block-unaligned lengths."""
    return shared_prefix_workload()
