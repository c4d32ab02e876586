"""The connectors' profiles: each one builds both roles through the container and serves
a warm pass with outputs equal to no connector."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml

from kvwire.config.profile import DEFAULT_PROFILE_NAME, load_profile, shipped_profile_path
from kvwire.engine.engine import LLMEngine
from kvwire.interface.base import KVConnectorRole
from tests.support.engines import generate, renamed, served, tokens, workload

PROFILES = {
    name: shipped_profile_path(name) for name in ("cpu-offload", "shared-storage", "tiered-disk")
}


def into_tmp(document: Any, tmp_path: pathlib.Path) -> Any:
    """The profile with its directories and pool sizes fit for a test machine."""
    if isinstance(document, dict):
        rewritten = {key: into_tmp(value, tmp_path) for key, value in document.items()}
        if "shared_storage_path" in rewritten:
            rewritten["shared_storage_path"] = str(tmp_path / "store")
        if "cpu_pool_bytes" in rewritten:
            rewritten["cpu_pool_bytes"] = "8MiB"
        if "max_bytes" in rewritten:
            rewritten["max_bytes"] = "64MiB"
        return rewritten
    if isinstance(document, list):
        return [into_tmp(item, tmp_path) for item in document]
    return document


def test_the_default_profile_is_cpu_offload():
    config = load_profile(DEFAULT_PROFILE_NAME)
    assert config.kv_transfer_config is not None
    assert config.kv_transfer_config.kv_connector == "CPUOffloadConnector"


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_each_profile_serves_a_warm_pass_with_identical_outputs(name, tmp_path: pathlib.Path):
    document = into_tmp(yaml.safe_load(PROFILES[name].read_text()), tmp_path)
    document["model_config"] = {"num_layers": 2, "vocab_size": 300, "max_model_len": 512}
    document.setdefault("cache_config", {}).update(block_size=4, num_gpu_blocks=128)
    config = load_profile(document)
    reference = tokens(generate(load_profile({**document, "kv_transfer_config": None}), workload()))
    with LLMEngine(config) as engine:
        cold = engine.generate(workload())
        engine.reset_prefix_cache()
        warm = engine.generate(renamed(workload(), "-warm"))
        roles = {engine.scheduler_connector.role} if engine.scheduler_connector else set()
    assert roles == {KVConnectorRole.SCHEDULER}
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    assert served(warm) > 0
