"""MultiConnector split by role: each instance holds only its role's half and refuses the other's.

A call of the other role raises ConnectorRoleError naming the call and the
role, and reaches no child; the calls both roles make (stats, the step
metadata, shutdown, the children) are answered in either role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.connectors.multi import MultiConnector, MultiKVConnectorMetadata
from kvwire.connectors.multi.scheduler import MultiSchedulerHalf
from kvwire.connectors.multi.worker import MultiWorkerHalf
from kvwire.container import KVConnectorContainer
from kvwire.exceptions import ConnectorRoleError
from kvwire.interface.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from kvwire.interface.calls import CallSide, calls_on
from kvwire.interface.types import (
    ForwardContext,
    KVCacheBlocks,
    KVConnectorOutput,
    KVConnectorStats,
    Request,
    SchedulerOutput,
)
from kvwire.testing import IdleConnector
from tests.support.pairs import cache_config_for, engine_config, make_request

REQUEST = make_request("a", list(range(100, 108)), 4)
STEP_METADATA = MultiKVConnectorMetadata(children=(KVConnectorMetadata(), KVConnectorMetadata()))

Call = Callable[[MultiConnector], object]

WORKER_CALLS: dict[str, Call] = {
    "register_kv_caches": lambda multi: multi.register_kv_caches({}),
    "register_cross_layers_kv_cache": (
        lambda multi: multi.register_cross_layers_kv_cache(torch.zeros(1), None)
    ),
    "get_mem_pool_context": lambda multi: multi.get_mem_pool_context(),
    "set_host_xfer_buffer_ops": lambda multi: multi.set_host_xfer_buffer_ops(lambda *args: None),
    "handle_preemptions": lambda multi: multi.handle_preemptions(STEP_METADATA),
    "finish_forward": lambda multi: multi.finish_forward(),
    "reset_capture_state": lambda multi: multi.reset_capture_state(),
    "start_load_kv": lambda multi: multi.start_load_kv(ForwardContext(layer_names=())),
    "wait_for_layer_load": lambda multi: multi.wait_for_layer_load("layer.0"),
    "save_kv_layer": lambda multi: multi.save_kv_layer("layer.0", torch.zeros(1), None),
    "wait_for_save": lambda multi: multi.wait_for_save(),
    "load_errors_this_step": lambda multi: multi.load_errors_this_step(),
    "skip_saves_computed_from": lambda multi: multi.skip_saves_computed_from({1}),
    "get_finished": lambda multi: multi.get_finished(set()),
    "get_transfer_results": lambda multi: multi.get_transfer_results(set()),
    "get_block_ids_with_load_errors": lambda multi: multi.get_block_ids_with_load_errors(),
    "get_kv_connector_kv_cache_events": lambda multi: multi.get_kv_connector_kv_cache_events(),
    "wait_for_pending_saves": lambda multi: multi.wait_for_pending_saves(0.0),
    "get_handshake_metadata": lambda multi: multi.get_handshake_metadata(),
    "build_connector_worker_meta": lambda multi: multi.build_connector_worker_meta(),
}

SCHEDULER_CALLS: dict[str, Call] = {
    "bind_kv_cache_manager": lambda multi: multi.bind_kv_cache_manager(NoBlockPool()),
    "bind_gpu_block_pool": lambda multi: multi.bind_gpu_block_pool(object()),
    "on_new_request": lambda multi: multi.on_new_request(REQUEST),
    "get_loaded_kv_cache_group_ids": lambda multi: multi.get_loaded_kv_cache_group_ids(REQUEST),
    "get_num_new_matched_tokens": lambda multi: multi.get_num_new_matched_tokens(REQUEST, 0),
    "update_state_after_alloc": lambda multi: multi.update_state_after_alloc(
        REQUEST, KVCacheBlocks(([0],)), 0
    ),
    "get_external_cache_hit_sources": lambda multi: multi.get_external_cache_hit_sources(
        REQUEST, 0
    ),
    "build_connector_meta": lambda multi: multi.build_connector_meta(SchedulerOutput()),
    "update_connector_output": lambda multi: multi.update_connector_output(KVConnectorOutput()),
    "request_finished": lambda multi: multi.request_finished(REQUEST, [0]),
    "request_finished_all_groups": lambda multi: multi.request_finished_all_groups(REQUEST, ([0],)),
    "register_finished_partial_tail": lambda multi: multi.register_finished_partial_tail(
        REQUEST, ([0],), []
    ),
    "take_events": lambda multi: multi.take_events(),
    "has_pending_block_frees": lambda multi: multi.has_pending_block_frees(),
    "has_pending_push_work": lambda multi: multi.has_pending_push_work(),
    "get_finished_count": lambda multi: multi.get_finished_count(),
    "set_xfer_handshake_metadata": lambda multi: multi.set_xfer_handshake_metadata({}),
    "set_xfer_handshake_metadata_pp_aware": (
        lambda multi: multi.set_xfer_handshake_metadata_pp_aware({})
    ),
    "reset_cache": lambda multi: multi.reset_cache(),
}

ANSWERED_WITHOUT_A_LOADING_CHILD = (
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
)

BOTH_ROLES_CALLS = (
    "get_kv_connector_stats",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "shutdown",
)


# Asked of a role's instance, but answered by the MultiConnector itself from its children.
PROPERTIES = {
    "prefer_cross_layer_blocks",
    "requires_kv_delivery",
    "supports_divergent_local_hybrid_hits",
}


def test_every_call_of_the_interface_made_by_one_role_or_both_is_tried() -> None:
    assert set(WORKER_CALLS) | set(SCHEDULER_CALLS) | PROPERTIES == set(
        calls_on(CallSide.WORKER, CallSide.SCHEDULER)
    )
    assert set(WORKER_CALLS) <= set(calls_on(CallSide.WORKER))
    assert set(SCHEDULER_CALLS) <= set(calls_on(CallSide.SCHEDULER))
    assert set(BOTH_ROLES_CALLS) == set(calls_on(CallSide.BOTH))


class NoBlockPool:
    """A KV cache manager, as far as bind_kv_cache_manager looks: its block pool."""

    block_pool = None


class StatsChild(IdleConnector, SupportsHMA):
    """A child with one save to report, in whichever role it was built."""

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return KVConnectorStats(data={"blocks_saved": 1})

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


CHILD = {"kv_connector": "StatsChild", "kv_connector_module_path": __name__}


def build(role: KVConnectorRole, calls: list[str] | None = None) -> MultiConnector:
    """A MultiConnector of two children; each call reaching a child is added to ``calls``."""
    config = engine_config("MultiConnector", {"connectors": [CHILD, dict(CHILD)]})
    # The builder a container hands a composite, each child it builds noted.
    build_through_container = KVConnectorContainer().connector_builder()

    def build_child(
        child_config: EngineConfig, child_role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> KVConnectorBase:
        child = build_through_container(child_config, child_role, kv_cache_config)
        if calls is not None:
            for name in (*WORKER_CALLS, *SCHEDULER_CALLS, *BOTH_ROLES_CALLS):
                setattr(child, name, _noted(calls, name, getattr(child, name)))
        return child

    return MultiConnector(config, role, cache_config_for(config), connector_builder=build_child)


def _noted(calls: list[str], name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return method(*args, **kwargs)

    return call


@pytest.mark.parametrize(
    ("side", "call", "role", "other_role"),
    [
        *(
            ("worker", name, KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER)
            for name in WORKER_CALLS
        ),
        *(
            ("scheduler", name, KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
            for name in SCHEDULER_CALLS
        ),
    ],
    ids=[*WORKER_CALLS, *SCHEDULER_CALLS],
)
def test_a_call_of_the_other_role_is_refused_naming_it_and_reaches_no_child(
    side: str, call: str, role: KVConnectorRole, other_role: KVConnectorRole
) -> None:
    calls = {**WORKER_CALLS, **SCHEDULER_CALLS}[call]
    reached: list[str] = []
    wrong = build(other_role, reached)

    with pytest.raises(ConnectorRoleError) as raised:
        calls(wrong)

    assert str(raised.value) == (
        f"MultiConnector: {call} is a {side}-side call, but this connector was built for the "
        f"{other_role.name} role and holds no {side} state; build one with "
        f"KVConnectorRole.{role.name} for it (the engine builds one connector per role)"
    )
    assert reached == []
    # The connector of the call's own role answers it, through its children
    # (or itself, for a request no child serves).
    calls(build(role, reached))
    assert call in reached or call in ANSWERED_WITHOUT_A_LOADING_CHILD


@pytest.mark.parametrize(
    ("role", "own_half", "other_half"),
    [
        (KVConnectorRole.SCHEDULER, MultiSchedulerHalf, MultiWorkerHalf),
        (KVConnectorRole.WORKER, MultiWorkerHalf, MultiSchedulerHalf),
    ],
    ids=["scheduler", "worker"],
)
def test_each_role_holds_only_its_own_half_and_answers_the_calls_both_roles_make(
    role: KVConnectorRole, own_half: type, other_half: type
) -> None:
    reached: list[str] = []
    multi = build(role, reached)

    held = [value for value in vars(multi).values() if isinstance(value, own_half | other_half)]
    assert [type(half) for half in held] == [own_half]
    # vLLM's scheduler asks its connector for stats too, beside each worker's.
    stats = multi.get_kv_connector_stats()
    assert stats is not None
    assert stats.data == {"StatsChild": {"blocks_saved": 1}, "StatsChild#1": {"blocks_saved": 1}}
    multi.bind_connector_metadata(STEP_METADATA)
    assert multi.has_connector_metadata()
    multi.clear_connector_metadata()
    assert multi.requires_kv_delivery is True  # kv_both children produce
    assert [type(child) for child in multi.children] == [StatsChild, StatsChild]
    multi.shutdown()
    assert [name for name in reached if name in BOTH_ROLES_CALLS] == [
        name for name in BOTH_ROLES_CALLS for _ in range(2)
    ]
