"""The engine benchmark's new figures on the tiny model: they mean what they say.

Times are not checked, only how they are gathered and put together.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from benchmarks import engine as bench
from kvwire.connectors.offload.metadata import OffloadMetadata
from kvwire.interface.base import KVConnectorRole


def test_the_forward_share_counts_the_saving_steps_connector_calls() -> None:
    found = bench.measure_forward_share(
        "CPUOffloadConnector", quick=True, preset="tiny", prompt_len=64
    )
    assert 1 <= found["saving_steps"] <= found["steps"]
    assert 0 < found["forward_share"] <= found["max_step_share"] < 1
    by_call = found["connector_ms_by_call"]
    for name in ("bind_connector_metadata", "start_load_kv", "wait_for_save"):
        assert name in by_call
    assert sum(by_call.values()) == pytest.approx(found["connector_ms_per_saving_step"])
    assert found["connector_ms_per_saving_step"] < found["step_ms_per_saving_step"]
    # The tiny model's block of 16 tokens: 2 layers x K and V x 16 x 2 heads x 16 x float32.
    assert found["mib_saved_per_saving_step"] * 2**20 % (2 * 2 * 16 * 2 * 16 * 4) == 0
    assert found["connector_ms_per_mib_saved"] == pytest.approx(
        found["connector_ms_per_saving_step"] / found["mib_saved_per_saving_step"]
    )


class _SelfCallingConnector:
    """Its wait_for_save calls its own get_finished, as a connector may."""

    role = KVConnectorRole.WORKER

    def __init__(self) -> None:
        self.calls: list[str] = []

    def bind_connector_metadata(self, metadata: object) -> None:
        self.calls.append("bind")

    def wait_for_save(self) -> None:
        self.calls.append("save")
        self.get_finished(set())

    def get_finished(self, finished: set[str]) -> tuple[None, None]:
        self.calls.append("finished")
        return None, None


def test_a_call_a_connector_makes_on_itself_is_timed_once_inside_the_outer_one() -> None:
    connector = _SelfCallingConnector()
    timer = bench.ForwardThreadTimer()
    timer(connector)  # type: ignore[arg-type]

    def execute(step: Any) -> str:
        save = types.SimpleNamespace(block_ids=(3, 4))
        connector.bind_connector_metadata(OffloadMetadata(saves=(save, save)))  # type: ignore[arg-type]
        connector.wait_for_save()
        return "result"

    engine = types.SimpleNamespace(worker=types.SimpleNamespace(execute=execute))
    timer.time_steps(engine)  # type: ignore[arg-type]
    assert engine.worker.execute(None) == "result"
    assert connector.calls == ["bind", "save", "finished"]
    (step,) = timer.steps
    assert step.saves and step.blocks_saved == 4
    assert sorted(step.by_call) == ["bind_connector_metadata", "wait_for_save"]
    assert step.connector_s == pytest.approx(sum(step.by_call.values()))
    assert step.connector_s <= step.step_s


def test_a_scheduler_connector_is_left_alone() -> None:
    connector = _SelfCallingConnector()
    connector.role = KVConnectorRole.SCHEDULER
    bench.ForwardThreadTimer()(connector)  # type: ignore[arg-type]
    assert "wait_for_save" not in vars(connector)


def test_a_step_metadata_without_saves_is_an_error_naming_its_type() -> None:
    assert bench.blocks_to_save(OffloadMetadata()) == 0
    with pytest.raises(TypeError, match="SimpleNamespace has no saves"):
        bench.blocks_to_save(types.SimpleNamespace())


def test_warm_over_local_is_the_best_warm_median_over_the_best_local_one() -> None:
    found = bench.measure_warm_vs_local(
        "CPUOffloadConnector", quick=True, preset="tiny", prompt_len=64
    )
    best = found["ttft_p50_ms_best"]
    assert found["outputs_identical"]
    assert found["warm_vs_local_ttft_p50"] == pytest.approx(best["warm"] / best["local"])
    # 4 prompts of 4 blocks of 16: the local pass hits each one's first 3.
    assert found["tokens_from_local_cache_local"] == 4 * 48
    assert found["tokens_from_connector_warm"] > 0
