"""What KVWireConnector takes from vLLM's configuration, checked on a connector built directly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvwire.vllm import KVWireConnector, KVWireHMAConnector
from kvwire.vllm.config_bridge import VLLMConfigError
from tests.vllm.engines import BLOCK_SIZE, kvwire_transfer_config, load_profile_mapping


def vllm_config(model: str, **transfer: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    config = {**kvwire_transfer_config(load_profile_mapping("cpu-offload.yaml")), **transfer}
    return EngineArgs(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        enforce_eager=True,
        kv_transfer_config=config,
    ).create_engine_config()


def vllm_kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    tensors = [
        KVCacheTensor(
            size=spec.page_size_bytes * 8,
            layers=[name],
            layer_stride=0,
            block_stride=spec.page_size_bytes,
        )
        for name in names
    ]
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
    )


def scheduler_connector(connector_class: type, config: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return connector_class(config, KVConnectorRole.SCHEDULER, vllm_kv_cache_config())


def test_load_failure_policy_and_role_are_vllm_s(tiny_model: str) -> None:
    config = vllm_config(tiny_model, kv_role="kv_producer", kv_load_failure_policy="fail")
    wrapped = scheduler_connector(KVWireConnector, config).connector
    assert wrapped.kv_transfer_config.kv_load_failure_policy == "fail"
    assert wrapped.kv_transfer_config.kv_role == "kv_producer"


def test_a_best_effort_cache_never_requires_kv_delivery(tiny_model: str) -> None:
    connector = scheduler_connector(KVWireConnector, vllm_config(tiny_model, kv_role="kv_producer"))
    assert connector.requires_kv_delivery is False


def test_stored_blocks_are_named_by_model_dtype_block_size_and_vllm_cpu_layout(
    tiny_model: str,
) -> None:
    layout = scheduler_connector(KVWireConnector, vllm_config(tiny_model)).connector.layout
    assert (layout.model_identity, layout.dtype, layout.block_size, layout.cache_layout) == (
        tiny_model,
        "float32",
        BLOCK_SIZE,
        "vllm_cpu",
    )


def test_hma_connector_refuses_a_wrapped_connector_without_hma(tiny_model: str) -> None:
    with pytest.raises(VLLMConfigError, match="CPUOffloadConnector does not support"):
        scheduler_connector(KVWireHMAConnector, vllm_config(tiny_model))
