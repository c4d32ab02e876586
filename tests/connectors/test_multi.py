"""MultiConnector: CPU offload in front of shared storage, children built through the registry."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from dependency_injector import providers

from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.connector.base import KVConnectorRole, SupportsHMA
from kvwire.connector.types import Request, SchedulerOutput
from kvwire.connectors.cpu_offload import CPUOffloadConnector
from kvwire.connectors.extra_config import ExtraConfigError
from kvwire.connectors.multi import MultiConnector
from kvwire.connectors.shared_storage import SharedStorageConnector
from kvwire.container import KVConnectorContainer
from kvwire.registry import default_registry
from tests.connectors.conftest import OpenPair, PairFactory
from tests.connectors.harness import (
    ConnectorPair,
    blocks_equal,
    cache_config_for,
    engine_config,
    make_request,
)

BLOCK = 4
PROMPT = list(range(100, 117))
FIRST = [3, 7, 1, 9, 12]
SECOND = [20, 21, 22, 23, 24]


class ParamsCPUOffload(CPUOffloadConnector):
    """A child found by module path that returns kv_transfer_params."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        keep, _ = super().request_finished(request, block_ids)
        return keep, {"remote_block_ids": list(block_ids)}


class HMACPUOffload(CPUOffloadConnector, SupportsHMA):
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])


SMALL_POOL = {"kv_connector_extra_config": {"cpu_pool_bytes": "4MiB"}}
CPU_CHILD = {"kv_connector": "CPUOffloadConnector", **SMALL_POOL}


def tiered(storage: pathlib.Path) -> list[dict[str, Any]]:
    return [
        CPU_CHILD,
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        },
    ]


@pytest.fixture
def make_pair(tmp_path: pathlib.Path, open_pair: OpenPair) -> PairFactory:
    registry = default_registry()

    def build(children: list[dict[str, Any]] | None = None, seed: int = 1) -> ConnectorPair:
        config = engine_config(
            "MultiConnector", {"connectors": children or tiered(tmp_path / "store")}
        )
        return open_pair(config, MultiConnector, seed, connector_builder=registry.build_connector)

    return build


def offload(pair: ConnectorPair, request_id: str = "a") -> None:
    request = make_request(request_id, PROMPT, BLOCK)
    pair.prefill(request, FIRST)
    pair.finish(request, FIRST)
    for child in pair.worker.children:
        if isinstance(child, SharedStorageConnector):
            assert child.wait_for_pending_saves(30)
    pair.step(SchedulerOutput())  # collects the stats of the saves that just ended


def test_children_are_built_from_the_extra_config_in_order(make_pair):
    pair = make_pair()
    kinds = [type(child) for child in pair.scheduler.children]
    assert kinds == [CPUOffloadConnector, SharedStorageConnector]


def test_the_first_child_with_a_hit_loads(make_pair):
    pair = make_pair()
    offload(pair)
    pair.stats.clear()
    pair.nested_stats.clear()
    pair.prefill(make_request("b", PROMPT, BLOCK), SECOND)
    pair.step(SchedulerOutput())
    assert blocks_equal(pair.caches, FIRST[:4], pair.caches, SECOND[:4])
    assert pair.worker_stats_of("CPUOffloadConnector")["blocks_loaded"] == 4
    assert "blocks_loaded" not in pair.worker_stats_of("SharedStorageConnector")


def test_a_later_tier_serves_what_the_first_does_not_hold(make_pair):
    producer = make_pair()
    offload(producer)
    consumer = make_pair(seed=2)  # a fresh CPU pool over the same directory
    assert consumer.prefill(make_request("b", PROMPT, BLOCK), SECOND) == (16, False)
    assert blocks_equal(producer.caches, FIRST[:4], consumer.caches, SECOND[:4])
    assert consumer.worker_stats_of("SharedStorageConnector")["blocks_loaded"] == 4


def test_saves_go_to_every_child(make_pair, tmp_path: pathlib.Path):
    pair = make_pair()
    offload(pair)
    cpu, disk = pair.scheduler.children
    request = make_request("b", PROMPT, BLOCK)
    assert cpu.get_num_new_matched_tokens(request, 0) == (16, False)
    assert disk.get_num_new_matched_tokens(request, 0) == (16, False)


def test_stats_are_nested_per_child(make_pair):
    pair = make_pair()
    offload(pair)
    assert set(pair.nested_stats) == {"CPUOffloadConnector", "SharedStorageConnector"}
    assert pair.worker_stats_of("SharedStorageConnector")["blocks_saved"] == 4


def test_a_request_is_finished_sending_once_every_keeping_child_reported_it(make_pair):
    pair = make_pair(
        [
            CPU_CHILD,
            CPU_CHILD,
        ]
    )
    request = make_request("a", PROMPT, BLOCK)
    pair.prefill(request, FIRST)
    assert pair.finish(request, FIRST) is True
    assert pair.finished_sending == {"a"}
    first, second = pair.scheduler.children
    assert first.get_num_new_matched_tokens(request, 0) == (16, False)
    assert second.get_num_new_matched_tokens(request, 0) == (16, False)


def test_a_child_loaded_by_module_path_works_and_clashing_params_are_an_error(make_pair):
    child = {"kv_connector": "ParamsCPUOffload", "kv_connector_module_path": __name__, **SMALL_POOL}
    pair = make_pair([child, dict(child)])
    request = make_request("a", PROMPT, BLOCK)
    pair.prefill(request, FIRST)
    with pytest.raises(
        RuntimeError,
        match=r"Key clash in kv_transfer_params from multiple connectors: \{'remote_block_ids'\}",
    ):
        pair.scheduler.request_finished(request, FIRST)


def test_distinct_params_are_merged(make_pair):
    child = {"kv_connector": "ParamsCPUOffload", "kv_connector_module_path": __name__, **SMALL_POOL}
    pair = make_pair([child, CPU_CHILD])
    request = make_request("a", PROMPT, BLOCK)
    pair.prefill(request, FIRST)
    assert pair.scheduler.request_finished(request, FIRST) == (
        True,
        {"remote_block_ids": FIRST},
    )


def hma_of(children: list[dict[str, Any]]) -> bool:
    registry = default_registry()
    config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )
    return registry.supports_hma_config(config)


HMA_CHILD = {"kv_connector": "HMACPUOffload", "kv_connector_module_path": __name__, **SMALL_POOL}


def test_hma_is_supported_when_every_child_supports_it():
    assert hma_of([HMA_CHILD, dict(HMA_CHILD)]) is True


def test_hma_is_not_supported_when_one_child_lacks_it():
    assert hma_of([HMA_CHILD, CPU_CHILD]) is False


def test_hma_is_not_supported_without_children():
    assert hma_of([]) is False


def build_scheduler_side(extra: dict[str, Any]) -> MultiConnector:
    """A MultiConnector's scheduler side with ``extra``, its children through the registry."""
    config = engine_config("MultiConnector", extra)
    return MultiConnector(
        config,
        KVConnectorRole.SCHEDULER,
        cache_config_for(config),
        connector_builder=default_registry().build_connector,
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "kv_connector_extra_config.connectors: None is not accepted by MultiConnector"),
        ({"connectors": []}, "expected a non-empty list of kv_transfer_config mappings"),
        (
            {"connectors": ["CPUOffloadConnector"]},
            "kv_connector_extra_config.connectors[0]: expected a mapping of kv_transfer_config "
            "fields, got a str",
        ),
        (
            {"connectors": [CPU_CHILD, 8]},
            "kv_connector_extra_config.connectors[1]: expected a mapping of kv_transfer_config "
            "fields, got an int",
        ),
        ({"connectors": [{"kv_role": "kv_both"}]}, "connectors[0].kv_connector: expected"),
        (
            {"connectors": [{"kv_connector": "CPUOffloadConnector", "kv_port": 0}]},
            "kv_connector_extra_config.connectors[0]: kv_port must be between 1 and 65535",
        ),
        (
            {"connectors": [CPU_CHILD], "mode": "all"},
            "kv_connector_extra_config.mode is not an option of MultiConnector",
        ),
        (
            # Only the constructor can tell (it depends on the model's block size).
            {
                "connectors": [
                    CPU_CHILD,
                    {
                        "kv_connector": "CPUOffloadConnector",
                        "kv_connector_extra_config": {"cpu_pool_bytes": 16},
                    },
                ]
            },
            "kv_connector_extra_config.connectors[1].kv_connector_extra_config.cpu_pool_bytes: "
            "16 bytes hold no block",
        ),
    ],
)
def test_bad_children_name_the_entry_at_fault(extra, message):
    with pytest.raises(ExtraConfigError) as raised:
        build_scheduler_side(extra)
    assert message in str(raised.value)


SECRET_URL = "redis://:hunter2@cache.internal:6379/0"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"connectors": [CPU_CHILD, SECRET_URL]},
            "kv_connector_extra_config.connectors[1]: expected a mapping of kv_transfer_config "
            "fields, got a str",
        ),
        (
            {"connectors": SECRET_URL},
            "kv_connector_extra_config.connectors: a str is not accepted by MultiConnector; "
            "expected a non-empty list of kv_transfer_config mappings",
        ),
    ],
)
def test_a_misplaced_value_is_named_by_its_type_and_never_echoed(extra, message):
    # A secret typed in the wrong place must not end up in an error, hence in a log.
    with pytest.raises(ExtraConfigError) as raised:
        build_scheduler_side(extra)
    assert str(raised.value) == message
    assert "hunter2" not in str(raised.value)


def test_the_container_builds_children_through_overridden_providers(tmp_path: pathlib.Path):
    config: EngineConfig = engine_config(
        "MultiConnector", {"connectors": tiered(tmp_path / "store")}
    )
    container = KVConnectorContainer()
    container.engine_config.override(providers.Object(config))
    container.kv_cache_config.override(providers.Object(cache_config_for(config)))
    registry = container.registry()
    with registry.provider("CPUOffloadConnector").override(providers.Object(ParamsCPUOffload)):
        multi = container.scheduler_connector()
    assert isinstance(multi, MultiConnector)
    assert [type(c) for c in multi.children] == [ParamsCPUOffload, SharedStorageConnector]
    container.shutdown_resources()
