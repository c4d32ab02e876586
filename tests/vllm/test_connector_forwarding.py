"""Every call of kvwire's connector interface is either passed on by KVWireConnector or left to
vLLM's default on purpose, and the calls passed on as they are reach the wrapped connector."""

from __future__ import annotations

from unittest import mock

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvwire.interface.base import KVConnectorBase
from kvwire.vllm.connector import KVWireConnector

_NO_HANDSHAKE = "kvwire's connectors exchange no handshake through vLLM"

# The calls vLLM makes where KVWireConnector keeps vLLM's default, and why
# (kvwire.vllm.connector's module docstring says the same).
VLLM_DEFAULTS_KEPT = {
    "bind_kv_cache_manager": "vLLM's own manager: the scheduler side reads its block ids",
    "bind_gpu_block_pool": "vLLM's own block pool, bound with the manager",
    "on_new_request": "takes vLLM's request; kvwire's view of it exists from the first lookup",
    "get_loaded_kv_cache_group_ids": "takes vLLM's request; every group is loaded",
    "get_external_cache_hit_sources": "answers in vLLM's CacheHitSource, not kvwire's",
    "register_finished_partial_tail": "takes vLLM's request; no kvwire connector saves a tail",
    "get_handshake_metadata": _NO_HANDSHAKE,
    "set_xfer_handshake_metadata": _NO_HANDSHAKE,
    "set_xfer_handshake_metadata_pp_aware": _NO_HANDSHAKE,
    "get_finished_count": "a request is finished once every rank reported it (EveryRank)",
    "requires_piecewise_for_cudagraph": "a class-level question, asked before any profile is read",
    "supports_divergent_local_hybrid_hits": "vLLM's default: loads complete no lagging group",
}

# What every connector keeps of its own rather than asking the wrapped one.
_OWN = {"role", "has_connector_metadata", "_get_connector_metadata", "_cache_hit_source"}

# Passed on unchanged: calling one calls the wrapped connector's with the same arguments.
_PASSED_ON_AS_THEY_ARE = {
    "get_mem_pool_context": (),
    "set_host_xfer_buffer_ops": (mock.sentinel.copy_operation,),
    "finish_forward": (),
    "reset_capture_state": (),
    "wait_for_layer_load": ("layer.0",),
    "wait_for_save": (),
    "get_finished": ({"request"},),
    "wait_for_pending_saves": (5.0,),
    "build_connector_worker_meta": (),
    "has_pending_block_frees": (),
    "reset_cache": (),
}


def _interface_calls_vllm_makes() -> list[str]:
    return sorted(
        name
        for name in dir(KVConnectorBase)
        if not (name.startswith("__") and name.endswith("__"))
        and name not in _OWN
        and name != "_abc_impl"
        # kvwire's own hooks (load_errors_this_step, validate_extra_config, ...):
        # vLLM never calls them, the wrapped connector's engine-side caller is KVWireConnector.
        and hasattr(KVConnectorBase_V1, name)
    )


def test_every_call_vllm_makes_is_passed_on_or_left_to_vllms_default_on_purpose() -> None:
    undecided = [
        name
        for name in _interface_calls_vllm_makes()
        if name not in vars(KVWireConnector) and name not in VLLM_DEFAULTS_KEPT
    ]
    passed_on_and_kept = sorted(set(VLLM_DEFAULTS_KEPT) & set(vars(KVWireConnector)))

    assert undecided == []
    assert passed_on_and_kept == []
    assert set(VLLM_DEFAULTS_KEPT) <= set(_interface_calls_vllm_makes())


@pytest.mark.parametrize("name", sorted(_PASSED_ON_AS_THEY_ARE))
def test_a_call_passed_on_as_it_is_reaches_the_wrapped_connector(name: str) -> None:
    connector = object.__new__(KVWireConnector)
    connector.connector = mock.Mock()
    arguments = _PASSED_ON_AS_THEY_ARE[name]

    answer = getattr(connector, name)(*arguments)

    wrapped = getattr(connector.connector, name)
    wrapped.assert_called_once_with(*arguments)
    assert answer is wrapped.return_value or answer is None
