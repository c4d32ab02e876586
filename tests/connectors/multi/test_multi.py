"""MultiConnector: CPU offload in front of shared storage, children built through the registry."""

from __future__ import annotations

import logging
import pathlib
import uuid
from typing import Any

import attrs
import pytest
from dependency_injector import providers

from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.multi import MultiConnector, MultiKVConnectorMetadata
from kvwire.connectors.multi._children import child_transfer_configs
from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.container import KVConnectorContainer
from kvwire.interface.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    supports_hma,
)
from kvwire.interface.types import (
    KVConnectorOutput,
    KVConnectorStats,
    KVConnectorTransferResults,
    Request,
    SchedulerOutput,
)
from kvwire.registry import default_registry
from kvwire.testing import IdleConnector
from tests.support.pairs import (
    ConnectorPair,
    OpenPair,
    PairFactory,
    blocks_equal,
    build_multi,
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


class GroupsRecordingCPUOffload(CPUOffloadConnector):
    """A built-in HMA child that records the per-group block ids it is finished with."""

    finished_with: list[tuple[list[int], ...]] = []

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        type(self).finished_with.append(block_ids)
        return False, None


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
    def build(children: list[dict[str, Any]] | None = None, seed: int = 1) -> ConnectorPair:
        config = engine_config(
            "MultiConnector", {"connectors": children or tiered(tmp_path / "store")}
        )
        return open_pair(config, MultiConnector, seed)

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


NON_HMA_CHILD = {
    "kv_connector": "IdleConnector",
    "kv_connector_module_path": "kvwire.testing.idle",
}


def test_hma_is_supported_when_every_child_is_a_built_in(tmp_path):
    assert hma_of(tiered(tmp_path / "store")) is True


def test_hma_is_not_supported_when_one_child_lacks_it():
    assert hma_of([CPU_CHILD, NON_HMA_CHILD]) is False


def test_a_multi_of_built_ins_is_an_hma_connector_and_hands_every_child_each_group():
    recording = {
        "kv_connector": "GroupsRecordingCPUOffload",
        "kv_connector_module_path": __name__,
        **SMALL_POOL,
    }
    multi = build_scheduler_side({"connectors": [recording, dict(recording)]})
    GroupsRecordingCPUOffload.finished_with.clear()
    # Two groups from one pool; 0 is the null block a sliding-window group left behind.
    per_group = ([3, 7, 1], [0, 9, 12])

    assert supports_hma(multi)
    assert multi.request_finished_all_groups(make_request("a", PROMPT, BLOCK), per_group) == (
        False,
        None,
    )
    assert GroupsRecordingCPUOffload.finished_with == [per_group, per_group]
    multi.shutdown()


def test_hma_is_not_supported_without_children():
    assert hma_of([]) is False


def build_scheduler_side(extra: dict[str, Any]) -> MultiConnector:
    return build_multi(KVConnectorRole.SCHEDULER, extra)


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


# ------------------------------------------------- any child, through base hooks


class ProbeConnector(IdleConnector):
    """A child that is no offload connector; its extra config says how it behaves.

    ``load_errors``: block ids whose loads failed this step; ``fail_build`` /
    ``fail_shutdown``: raise there; ``finished_count``, ``layout``,
    ``worker_meta``: what those hooks answer. ``calls`` records the hooks it got.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = self._kv_transfer_config.kv_connector_extra_config
        if self.options.get("fail_build"):
            raise ValueError("the probe could not be built")
        self.calls: list[tuple[str, Any]] = []

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: EngineConfig) -> str | None:
        assert vllm_config.kv_transfer_config is not None
        layout: str | None = vllm_config.kv_transfer_config.kv_connector_extra_config.get("layout")
        return layout

    def load_errors_this_step(self) -> set[int]:
        return set(self.options.get("load_errors", ()))

    def skip_saves_computed_from(self, block_ids: set[int]) -> None:
        self.calls.append(("skip_saves_computed_from", block_ids))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.calls.append(("handle_preemptions", kv_connector_metadata))

    def on_new_request(self, request: Request) -> None:
        self.calls.append(("on_new_request", request.request_id))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        count = self.options.get("worker_meta")
        return None if count is None else CountMeta(count)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls.append(("worker_meta", connector_output.kv_connector_worker_meta))
        self.calls.append(("stats", connector_output.kv_connector_stats))

    def get_finished_count(self) -> int | None:
        count: int | None = self.options.get("finished_count")
        return count

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        failed = set(self.options.get("failed_recving", ()))
        return KVConnectorTransferResults(finished_recving=set(failed), failed_recving=failed)

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save", None))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return ProbeMetadata(self.options.get("name", ""))

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None))
        if self.options.get("fail_shutdown"):
            raise RuntimeError("the probe could not shut down")


@attrs.frozen
class ProbeMetadata(KVConnectorMetadata):
    name: str


@attrs.frozen
class CountMeta(KVConnectorWorkerMetadata):
    count: int

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CountMeta)
        return CountMeta(self.count + other.count)


class ProbeStats(KVConnectorStats):
    """The stats class ProbeConnector rebuilds its counters into."""


class StatsProbe(ProbeConnector):
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return ProbeStats(data=dict(data or {}))


def probe(**options: Any) -> dict[str, Any]:
    return {
        "kv_connector": "ProbeConnector",
        "kv_connector_module_path": __name__,
        "kv_connector_extra_config": options,
    }


def probes(*children: dict[str, Any]) -> MultiConnector:
    """The worker side of a MultiConnector over ``children``."""
    return build_multi(KVConnectorRole.WORKER, {"connectors": list(children)})


def scheduler_probes(*children: dict[str, Any]) -> MultiConnector:
    """The scheduler side of a MultiConnector over ``children``."""
    return build_multi(KVConnectorRole.SCHEDULER, {"connectors": list(children)})


def calls_named(connector: KVConnectorBase, name: str) -> list[Any]:
    assert isinstance(connector, ProbeConnector)
    return [argument for called, argument in connector.calls if called == name]


def test_a_failed_load_in_any_child_stops_every_child_saving_what_was_computed_from_it() -> None:
    multi = probes(probe(load_errors=[5, 9]), probe())

    multi.wait_for_save()

    assert [calls_named(child, "skip_saves_computed_from") for child in multi.children] == [
        [{5, 9}],
        [{5, 9}],
    ]
    assert [calls_named(child, "wait_for_save") for child in multi.children] == [[None], [None]]


def test_a_nested_multi_connector_passes_load_errors_up_and_skipped_saves_down() -> None:
    nested = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [probe(load_errors=[3])]},
    }
    multi = probes(nested, probe())
    inner, outer_probe = multi.children
    assert isinstance(inner, MultiConnector)

    multi.wait_for_save()

    assert {3} in calls_named(outer_probe, "skip_saves_computed_from")
    assert {3} in calls_named(inner.children[0], "skip_saves_computed_from")


def test_a_failing_child_shutdown_is_logged_and_the_others_still_shut_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    multi = probes(probe(fail_shutdown=True), probe())

    with (
        caplog.at_level(logging.ERROR, logger="kvwire.connectors.multi"),
        pytest.raises(RuntimeError, match="the probe could not shut down"),
    ):
        multi.shutdown()

    assert calls_named(multi.children[1], "shutdown") == [None]
    assert [record.getMessage() for record in caplog.records] == [
        "MultiConnector: child ProbeConnector failed to shut down; shutting down the others"
    ]


def test_a_child_that_cannot_be_built_is_the_error_even_when_cleanup_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="kvwire.connectors.multi"),
        pytest.raises(ValueError, match="the probe could not be built"),
    ):
        probes(probe(fail_shutdown=True), probe(fail_build=True))

    assert "failed to shut down" in caplog.text


def test_preemptions_reach_each_child_with_its_own_metadata() -> None:
    multi = probes(probe(name="first"), probe(name="second"))
    metadata = MultiKVConnectorMetadata(children=(ProbeMetadata("first"), ProbeMetadata("second")))

    multi.handle_preemptions(metadata)

    assert [calls_named(child, "handle_preemptions") for child in multi.children] == [
        [ProbeMetadata("first")],
        [ProbeMetadata("second")],
    ]


def test_failed_receives_of_any_child_are_reported() -> None:
    multi = probes(probe(failed_recving=["a"]), probe(failed_recving=["b"]))

    results = multi.get_transfer_results(set())

    assert results.failed_recving == {"a", "b"}
    assert multi.get_finished(set()) == (None, {"a", "b"})


def test_new_requests_reach_every_child() -> None:
    multi = scheduler_probes(probe(), probe())

    multi.on_new_request(make_request("n", PROMPT, BLOCK))

    assert [calls_named(child, "on_new_request") for child in multi.children] == [["n"], ["n"]]


def test_worker_metadata_is_built_per_child_merged_and_handed_back_to_each() -> None:
    one_worker = probes(probe(worker_meta=2), probe()).build_connector_worker_meta()
    assert one_worker is not None
    multi = scheduler_probes(probe(worker_meta=2), probe())

    merged = one_worker.aggregate(one_worker)
    multi.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=merged))

    assert [calls_named(child, "worker_meta") for child in multi.children] == [
        [CountMeta(4)],
        [None],
    ]


def test_no_worker_metadata_when_no_child_has_any() -> None:
    assert probes(probe(), probe()).build_connector_worker_meta() is None


def test_children_expecting_different_finished_counts_is_an_error() -> None:
    multi = scheduler_probes(probe(finished_count=2), probe(finished_count=4))

    with pytest.raises(ValueError, match=r"different numbers of finished reports \[2, 4\]"):
        multi.get_finished_count()


def test_the_finished_count_is_the_children_s_when_they_agree() -> None:
    agreeing = scheduler_probes(probe(finished_count=2), probe(finished_count=2))
    assert agreeing.get_finished_count() == 2
    assert scheduler_probes(probe(finished_count=2), probe()).get_finished_count() is None


def test_children_needing_different_kv_cache_layouts_is_an_error() -> None:
    config = engine_config(
        "MultiConnector", {"connectors": [probe(layout="HND"), probe(layout="NHD")]}
    )

    with pytest.raises(ValueError, match=r"different KV cache layouts \(HND, NHD\)"):
        MultiConnector.get_required_kvcache_layout(config)


def test_kv_delivery_is_required_when_a_child_requires_it() -> None:
    consumer = {**probe(), "kv_role": "kv_consumer"}
    producer = {**probe(), "kv_role": "kv_producer"}

    assert probes(consumer, producer).requires_kv_delivery is True
    assert probes(consumer, consumer).requires_kv_delivery is False


# --------------------------------------------------------------- child stats


@pytest.fixture
def stats_probe_name() -> str:
    name = f"StatsProbe{uuid.uuid4().hex}"
    default_registry().register_connector(name, __name__, "StatsProbe")
    return name


def test_each_child_s_stats_are_rebuilt_by_the_class_registered_under_its_name(
    stats_probe_name: str,
) -> None:
    rebuilt = MultiConnector.build_kv_connector_stats(
        {stats_probe_name: {"loads": 2}, f"{stats_probe_name}#1": {"loads": 3}}
    )

    assert rebuilt is not None
    assert [type(stats) for stats in rebuilt.data.values()] == [ProbeStats, ProbeStats]
    assert rebuilt.reduce() == {
        stats_probe_name: {"loads": 2},
        f"{stats_probe_name}#1": {"loads": 3},
    }


def test_rebuilt_child_stats_merge_child_by_child(stats_probe_name: str) -> None:
    first = MultiConnector.build_kv_connector_stats({stats_probe_name: {"loads": 2}})
    second = MultiConnector.build_kv_connector_stats({stats_probe_name: {"loads": 5}})
    assert first is not None and second is not None

    assert first.aggregate(second).reduce() == {stats_probe_name: {"loads": 7}}


def test_rebuilding_the_stats_of_an_unknown_child_is_the_reference_error() -> None:
    with pytest.raises(ValueError) as caught:
        MultiConnector.build_kv_connector_stats({"NoSuchConnector": {"loads": 1}})

    assert str(caught.value) == "Connector 'NoSuchConnector' is not registered."


def test_nested_child_stats_reach_each_child_as_its_own() -> None:
    multi = scheduler_probes(probe(), probe())
    nested = KVConnectorStats(data={"ProbeConnector#1": {"loads": 2}})

    multi.update_connector_output(KVConnectorOutput(kv_connector_stats=nested))

    assert [calls_named(child, "stats") for child in multi.children] == [
        [None],
        [KVConnectorStats(data={"loads": 2})],
    ]


def test_child_stats_rebuilt_by_the_multi_connector_class_reach_each_child_as_they_are(
    stats_probe_name: str,
) -> None:
    multi = scheduler_probes({"kv_connector": stats_probe_name})
    rebuilt = MultiConnector.build_kv_connector_stats({stats_probe_name: {"loads": 2}})

    multi.update_connector_output(KVConnectorOutput(kv_connector_stats=rebuilt))

    assert calls_named(multi.children[0], "stats") == [ProbeStats(data={"loads": 2})]


def _multi_transfer_config(extra: dict[Any, Any]) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )


def test_unknown_keys_of_mixed_types_are_named_not_a_sorting_crash() -> None:
    with pytest.raises(ExtraConfigError, match=r"^kv_connector_extra_config\.1 is not an option"):
        child_transfer_configs(_multi_transfer_config({"connectors": [CPU_CHILD], 1: 2, "x": 3}))


def test_an_unknown_key_is_named_bounded_and_escaped() -> None:
    with pytest.raises(ExtraConfigError) as raised:
        child_transfer_configs(_multi_transfer_config({"k\n" * 5000: 1}))

    message = str(raised.value)
    assert message.startswith("kv_connector_extra_config.'k\\nk\\n")
    assert "\n" not in message
    assert len(message) < 400
