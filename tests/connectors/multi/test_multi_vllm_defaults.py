"""MultiConnector over children that answer "nothing" as vLLM's base does: with None.

A connector written against vLLM's ``KVConnectorBase_V1`` returns None for
"no KV cache events", "no stats" and "no finished transfers"; the composite
treats each as empty beside its other children's.
"""

from __future__ import annotations

from typing import Any

from kvwire.connectors.multi import MultiConnector
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import BlockStored, KVCacheEvent, KVConnectorOutput, KVConnectorStats
from kvwire.testing import IdleConnector
from tests.support.pairs import build_multi

STORED = BlockStored(block_hashes=(b"\x01" * 32,), medium="cpu")


class VllmDefaultsConnector(IdleConnector):
    """Written as vLLM's connectors are: every "nothing to report" is None."""

    def get_kv_connector_kv_cache_events(self) -> Any:
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None


class ReportingConnector(VllmDefaultsConnector):
    """A sibling with something to report: one stored block, one save, one finished send."""

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        return [STORED]

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return KVConnectorStats(data={"blocks_saved": 1})

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return {"a"}, None


def child(name: str) -> dict[str, Any]:
    return {"kv_connector": name, "kv_connector_module_path": __name__}


def multi_of(role: KVConnectorRole, *names: str) -> MultiConnector:
    return build_multi(role, {"connectors": [child(name) for name in names]})


def test_a_child_reporting_no_kv_cache_events_as_none_adds_none() -> None:
    multi = multi_of(KVConnectorRole.WORKER, "VllmDefaultsConnector", "ReportingConnector")

    assert multi.get_kv_connector_kv_cache_events() == [STORED]


def test_a_step_output_without_kv_cache_events_still_reaches_every_child() -> None:
    # vLLM's KVConnectorOutput holds None, not an empty list, when no worker had events.
    multi = multi_of(KVConnectorRole.SCHEDULER, "VllmDefaultsConnector", "ReportingConnector")

    multi.update_connector_output(KVConnectorOutput(kv_cache_events=None))  # type: ignore[arg-type]

    assert list(multi.take_events()) == []


def test_a_child_with_no_stats_is_left_out_of_the_nested_stats() -> None:
    multi = multi_of(KVConnectorRole.WORKER, "VllmDefaultsConnector", "ReportingConnector")

    stats = multi.get_kv_connector_stats()

    assert stats is not None
    assert stats.data == {"ReportingConnector": {"blocks_saved": 1}}


def test_a_child_with_no_finished_transfers_leaves_the_siblings_reports_whole() -> None:
    multi = multi_of(KVConnectorRole.WORKER, "VllmDefaultsConnector", "ReportingConnector")

    assert multi.get_finished(set()) == ({"a"}, None)
