"""Every call of kvwire's connector interface that vLLM makes is passed on by KVWireConnector or
left to vLLM's default on purpose; each call passed on reaches its target in its own role."""

from __future__ import annotations

from unittest import mock

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from kvwire.exceptions import ConnectorRoleError
from kvwire.interface.base import KVConnectorBase
from kvwire.interface.base import SupportsHMA as KVWireSupportsHMA
from kvwire.interface.calls import INTERFACE_CALLS, CallSide
from kvwire.vllm.connector import PASSED_ON_AS_THEY_ARE, TRANSLATED, KVWireConnector
from kvwire.vllm.scheduler_half import KVWireSchedulerHalf
from kvwire.vllm.worker_half import KVWireWorkerHalf

_NO_HANDSHAKE = "kvwire's connectors exchange no handshake through vLLM"

# The calls vLLM makes where KVWireConnector keeps vLLM's default, and why
# (kvwire.vllm.connector's module docstring says the same).
VLLM_DEFAULTS_KEPT = {
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

# The arguments each call passed on as it is gets here.
_ARGUMENTS = {
    "get_mem_pool_context": (),
    "set_host_xfer_buffer_ops": (mock.sentinel.copy_operation,),
    "finish_forward": (),
    "reset_capture_state": (),
    "wait_for_layer_load": ("layer.0",),
    "save_kv_layer": ("layer.0", mock.sentinel.kv_layer, mock.sentinel.attn_metadata),
    "wait_for_save": (),
    "get_finished": ({"request"},),
    "wait_for_pending_saves": (5.0,),
    "build_connector_worker_meta": (),
    "has_pending_block_frees": (),
    "reset_cache": (),
}

_HALVES = {CallSide.SCHEDULER: KVWireSchedulerHalf, CallSide.WORKER: KVWireWorkerHalf}


def _interface_calls_vllm_makes() -> list[str]:
    return sorted(
        name
        for name in (*dir(KVConnectorBase), *vars(KVWireSupportsHMA))
        if not (name.startswith("__") and name.endswith("__"))
        and name not in _OWN
        and name != "_abc_impl"
        # kvwire's own hooks (load_errors_this_step, validate_extra_config, ...):
        # vLLM never calls them, the wrapped connector's engine-side caller is KVWireConnector.
        and (hasattr(KVConnectorBase_V1, name) or hasattr(SupportsHMA, name))
    )


def _built_for(role: KVConnectorRole) -> tuple[KVWireConnector, mock.Mock]:
    """A KVWireConnector of `role` around a mock connector, its half a mock too."""
    connector = object.__new__(KVWireConnector)
    connector._role = role
    connector.connector = mock.Mock()
    half = mock.Mock()
    if role is KVConnectorRole.SCHEDULER:
        connector._set_scheduler_half(half)
    else:
        connector._set_worker_half(half)
    return connector, half


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
    # Besides vLLM's calls: kvwire.vllm.engine_calls waits for the saves.
    assert set(PASSED_ON_AS_THEY_ARE) | set(TRANSLATED) <= {
        *_interface_calls_vllm_makes(),
        "wait_for_pending_saves",
    }


@pytest.mark.parametrize("name", TRANSLATED)
def test_a_translated_call_is_one_the_half_of_its_role_defines(name: str) -> None:
    assert name in vars(_HALVES[INTERFACE_CALLS[name]])


@pytest.mark.parametrize("half", list(_HALVES.values()), ids=lambda half: half.__name__)
def test_a_half_defines_no_call_that_does_not_reach_it(half: type) -> None:
    # Besides TRANSLATED, KVWireConnector's own methods call these on the half.
    called_by_the_connector = {
        "bind_connector_metadata",
        "clear_connector_metadata",
        "bind_kv_cache_manager",
    }
    defined = {name for name in vars(half) if name in INTERFACE_CALLS}

    assert defined - called_by_the_connector <= set(TRANSLATED)


@pytest.mark.parametrize("name", PASSED_ON_AS_THEY_ARE)
def test_a_call_passed_on_as_it_is_reaches_the_wrapped_connector(name: str) -> None:
    role = (
        KVConnectorRole.SCHEDULER
        if INTERFACE_CALLS[name] is CallSide.SCHEDULER
        else KVConnectorRole.WORKER
    )
    connector, half = _built_for(role)
    arguments = _ARGUMENTS[name]

    answer = getattr(connector, name)(*arguments)

    wrapped = getattr(connector.connector, name)
    wrapped.assert_called_once_with(*arguments)
    assert answer is wrapped.return_value
    assert half.mock_calls == []


def test_each_call_passed_on_as_it_is_gets_its_arguments_here() -> None:
    assert set(_ARGUMENTS) == set(PASSED_ON_AS_THEY_ARE)


@pytest.mark.parametrize("name", TRANSLATED)
def test_a_translated_call_reaches_the_half_of_its_role_and_is_refused_in_the_other(
    name: str,
) -> None:
    side = INTERFACE_CALLS[name]
    own, other = (
        (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
        if side is CallSide.SCHEDULER
        else (KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER)
    )
    connector, half = _built_for(own)

    answer = getattr(connector, name)(mock.sentinel.argument)

    getattr(half, name).assert_called_once_with(mock.sentinel.argument)
    assert answer is getattr(half, name).return_value
    wrong, _ = _built_for(other)
    with pytest.raises(ConnectorRoleError) as refused:
        getattr(wrong, name)(mock.sentinel.argument)
    assert str(refused.value) == (
        f"KVWireConnector: {name} is a {side.value}-side call, but this connector was built "
        f"for the {other.name} role and holds no {side.value} state; build one with "
        f"KVConnectorRole.{side.name} for it (the engine builds one connector per role)"
    )
