"""Media as plug-ins, and the offload connector split by role.

A new place to keep blocks is a medium, named in a profile, registered in a
registry, or swapped for a test by overriding the registry's provider; the
connector itself is never subclassed. Each connector instance holds only
its role's half.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
from dependency_injector import providers

from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.cli import check_profile
from kvwire.config import EngineConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import CPUOffloadConnector, OffloadConnector
from kvwire.connectors.offload._planner import BlockPlanner
from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
from kvwire.container import container_for_profile
from kvwire.engine.engine import LLMEngine
from kvwire.exceptions import ConnectorRoleError
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import BlockHash, ForwardContext, Request
from kvwire.media.base import MediumIndex
from kvwire.media.cpu_pool import CPUPoolMedium
from kvwire.media.store.medium import StoreMedium
from kvwire.registry import default_registry
from kvwire.registry.media import UnknownMediumError
from kvwire.testing.faulty_medium import FaultInjectingMedium
from tests.support.connectors import read_options
from tests.support.engines import (
    generate,
    served,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.pairs import (
    build_connector,
    cache_config_for,
    engine_config,
    make_caches,
)
from tests.support.stores import DictStore


class _DictStore(DictStore):
    """Entries in a dict of this module's own: a medium no connector knows of."""

    entries: ClassVar[dict[str, bytes]] = {}


class DictMedium(StoreMedium[_DictStore]):
    """A third-party medium: a store, and nothing else."""

    event_medium = "dict"

    def create_store(self, options: Mapping[str, Any]) -> _DictStore:
        return _DictStore()


class CountingCPUPool(CPUPoolMedium):
    """The CPU pool, counting the handlers built from it (one per worker-role connector)."""

    handlers_built = 0

    def build_handler(self, kv_caches: Mapping[str, Any], counters: Any) -> Any:
        type(self).handlers_built += 1
        return super().build_handler(kv_caches, counters)


@pytest.fixture(autouse=True)
def _empty_dict_store() -> Iterator[None]:
    _DictStore.entries.clear()
    yield
    _DictStore.entries.clear()


def _config(connector: str, extra: dict[str, Any]) -> EngineConfig:
    return engine_config(connector, extra)


def test_a_profile_names_a_medium_by_module_path_and_the_offload_connector_serves_it():
    config = with_connector(tiny_config(), "OffloadConnector", {"medium": f"{__name__}:DictMedium"})
    reference = tokens(generate(tiny_config(), workload()))

    cold = generate(config, workload())
    warm = generate(config, workload())

    assert tokens(cold) == reference
    assert tokens(warm) == reference
    assert served(warm) > 0
    assert _DictStore.entries, "the blocks were kept in the plug-in medium"


def test_a_medium_registered_at_run_time_is_found_by_name():
    registry = default_registry().copy()
    registry.media.register_medium("dict", __name__, "DictMedium")
    container = container_for_profile(
        with_connector(tiny_config(), "OffloadConnector", {"medium": "dict"}),
        registry=registry,
    )
    with LLMEngine(container.engine_config(), container=container) as engine:
        engine.generate(workload())
    assert _DictStore.entries
    # The process-wide registry never learnt the name.
    assert "dict" not in default_registry().media.names()


def test_overriding_a_medium_in_the_registry_reaches_the_connectors_it_builds():
    registry = default_registry().copy()
    config = with_connector(tiny_config(), "CPUOffloadConnector", {"cpu_pool_bytes": "8MiB"})
    container = container_for_profile(config, registry=registry)
    CountingCPUPool.handlers_built = 0
    with (
        registry.media.provider("cpu_pool").override(providers.Object(CountingCPUPool)),
        LLMEngine(config, container=container) as engine,
    ):
        outputs = engine.generate(workload())
    assert CountingCPUPool.handlers_built == 1
    assert tokens(outputs) == tokens(generate(tiny_config(), workload()))
    # The override was undone, and never reached the process-wide registry.
    assert registry.media.get_class("cpu_pool") is CPUPoolMedium
    assert default_registry().media.get_class("cpu_pool") is CPUPoolMedium


@pytest.mark.parametrize(
    ("medium", "reason"),
    [
        ("tape", r"unknown medium 'tape'; expected one of cpu_pool, directory, peer, redis"),
        (
            "kvwire.media.base:MediumContext",
            r"medium 'kvwire.media.base:MediumContext' is <class .*MediumContext'>, not a class",
        ),
        (
            "kvwire.no_such_module:Medium",
            r"medium 'kvwire.no_such_module:Medium' cannot be loaded: ModuleNotFoundError: No",
        ),
        (42, r"unknown medium 42"),
    ],
    ids=["unknown-name", "not-a-medium", "no-module", "not-a-string"],
)
def test_a_bad_medium_is_refused_naming_the_key(medium: object, reason: str):
    config = _config("OffloadConnector", {"medium": medium})
    with pytest.raises(ExtraConfigError, match=r"^kv_connector_extra_config\.medium: " + reason):
        OffloadConnector.validate_extra_config(config.kv_transfer_config, default_registry())


def test_a_medium_name_that_is_not_registered_is_an_unknown_medium_error():
    with pytest.raises(UnknownMediumError, match="unknown medium 'tape'"):
        default_registry().media.get_class("tape")
    with pytest.raises(ValueError, match="already registered"):
        default_registry().media.copy().register_medium("directory", __name__, "DictMedium")


def test_the_medium_s_keys_join_the_connector_s_own():
    config = _config("OffloadConnector", {"medium": f"{__name__}:DictMedium", "cpu_pool_bytes": 1})
    with pytest.raises(
        ExtraConfigError, match=r"^kv_connector_extra_config\.cpu_pool_bytes is not an option"
    ):
        read_options(OffloadConnector, config.kv_transfer_config)


def _pair(extra: dict[str, Any]) -> tuple[CPUOffloadConnector, CPUOffloadConnector]:
    config = _config("CPUOffloadConnector", extra)
    cache = cache_config_for(config)
    return (
        build_connector(CPUOffloadConnector, config, KVConnectorRole.SCHEDULER, cache),
        build_connector(CPUOffloadConnector, config, KVConnectorRole.WORKER, cache),
    )


def test_each_role_builds_only_its_own_half():
    scheduler, worker = _pair({"cpu_pool_bytes": "4MiB"})
    assert scheduler._scheduler is not None and scheduler._worker is None
    assert worker._worker is not None and worker._scheduler is None


def test_a_worker_call_on_a_scheduler_connector_names_the_call_and_the_role():
    scheduler, _worker = _pair({"cpu_pool_bytes": "4MiB"})
    with pytest.raises(
        ConnectorRoleError,
        match=r"^CPUOffloadConnector: start_load_kv is a worker-side call, but this connector "
        r"was built for the SCHEDULER role",
    ):
        scheduler.start_load_kv(ForwardContext(layer_names=()))


def test_a_scheduler_call_on_a_worker_connector_names_the_call_and_the_role():
    _scheduler, worker = _pair({"cpu_pool_bytes": "4MiB"})
    request = Request(request_id="r", prompt_token_ids=list(range(8)), max_tokens=1)
    with pytest.raises(
        ConnectorRoleError,
        match=r"^CPUOffloadConnector: get_num_new_matched_tokens is a scheduler-side call, but "
        r"this connector was built for the WORKER role",
    ):
        worker.get_num_new_matched_tokens(request, 0)


def test_both_roles_answer_the_calls_an_engine_makes_of_either():
    # vLLM's scheduler merges its connector's stats with the workers': the
    # scheduler role answers that it has none, and both roles shut down.
    scheduler, worker = _pair({"cpu_pool_bytes": "4MiB"})
    assert scheduler.get_kv_connector_stats() is None
    scheduler.shutdown()
    worker.shutdown()


def test_caches_registered_twice_are_refused_so_no_handler_is_left_open():
    _scheduler, worker = _pair({"cpu_pool_bytes": "4MiB"})
    config = _config("CPUOffloadConnector", {"cpu_pool_bytes": "4MiB"})
    caches = make_caches(cache_config_for(config))
    worker.register_kv_caches(caches)
    with pytest.raises(RuntimeError, match=r"register_kv_caches\(\) was called twice"):
        worker.register_kv_caches(caches)
    worker.shutdown()


class _HalfPlacingIndex(MediumIndex):
    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        return 0

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        return [(h, None if i % 2 else i) for i, h in enumerate(block_hashes)]


def test_a_medium_index_that_places_only_some_blocks_of_a_save_is_refused():
    planner = BlockPlanner(4, (CacheGroup(0, ("l0",), 4),), loads=True, saves=True)
    scheduler = OffloadSchedulerHalf(
        index=_HalfPlacingIndex(), planner=planner, num_groups=1, async_load=False
    )
    save = BlockTransfer(request_id="r", block_ids=(1, 2), block_hashes=(b"a", b"b"))
    with pytest.raises(TypeError, match=r"^_HalfPlacingIndex\.prepare_save gave a slot to some"):
        scheduler._place_save(save)


def test_kvwire_check_resolves_the_medium_through_the_registry_it_is_given(tmp_path):
    profile = tmp_path / "dict.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: OffloadConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    medium: dict\n"
    )
    registry = default_registry().copy()
    registry.media.register_medium("dict", __name__, "DictMedium")
    out, err = io.StringIO(), io.StringIO()

    assert check_profile(str(profile), registry=registry, out=out, err=err) == 0, err.getvalue()
    assert check_profile(str(profile), out=io.StringIO(), err=err) == 1
    assert "kv_connector_extra_config.medium: unknown medium 'dict'" in err.getvalue()


def test_an_unconfigured_fault_injecting_medium_is_refused_naming_the_key():
    config = _config(
        "OffloadConnector", {"medium": "kvwire.testing.faulty_medium:FaultInjectingMedium"}
    )
    with pytest.raises(
        ExtraConfigError,
        match=r"^kv_connector_extra_config\.medium: FaultInjectingMedium cannot be used: "
        r"FaultInjectingMedium\.extra_config_keys raised TypeError: "
        r"FaultInjectingMedium\.inner is not set",
    ):
        read_options(OffloadConnector, config.kv_transfer_config)


def test_a_fault_injecting_medium_keeps_an_event_name_of_its_own():
    class Named(FaultInjectingMedium):
        inner = CPUPoolMedium
        event_medium = "faulty-cpu"

    class Unnamed(FaultInjectingMedium):
        inner = CPUPoolMedium

    assert Named.event_medium == "faulty-cpu"
    assert Unnamed.event_medium == "cpu"


@pytest.mark.parametrize(
    ("name", "module_path", "class_name", "reason"),
    [
        ("my-store", __name__, "DictMedium", r"name must be an identifier, got 'my-store'"),
        ("mine", "a..b", "DictMedium", r"module_path must be a dotted module name .* got 'a\.\.b'"),
        ("mine", __name__, "Dict Medium", r"class_name must be a Python identifier, got"),
    ],
    ids=["name", "module-path", "class-name"],
)
def test_registering_a_medium_refuses_a_bad_name_module_or_class(
    name: str, module_path: str, class_name: str, reason: str
):
    with pytest.raises(ValueError, match=r"^register_medium: " + reason):
        default_registry().media.copy().register_medium(name, module_path, class_name)
