"""kvwire connectors the hybrid-model tests wrap: one without HMA, one with, both recording.

A profile names them by ``kv_connector`` and ``kv_connector_module_path``
(``tests.support.vllm_hybrid_connectors``), as a third-party connector is named.
They hold no KV: every lookup misses and nothing is saved.
"""

from __future__ import annotations

from typing import Any

from kvwire.interface.base import KVConnectorBase, KVConnectorMetadata, SupportsHMA
from kvwire.interface.types import Request, SchedulerOutput
from kvwire.testing import IdleConnector

MODULE = __name__


class PlainConnector(IdleConnector):
    """A connector without HMA that holds no KV, recording what it is handed.

    ``finished``: each ``request_finished`` call; ``scheduled``: each
    request's block ids in the last step that scheduled it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished: list[tuple[str, Any]] = []
        self.scheduled: dict[str, tuple[list[int], ...]] = {}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for item in scheduler_output.scheduled:
            self.scheduled[item.request_id] = item.block_ids
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(("request_finished", list(block_ids)))
        return False, None


class GroupsConnector(PlainConnector, SupportsHMA):
    """``PlainConnector`` with HMA: ``finished`` records each group's block ids."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(("request_finished_all_groups", tuple(block_ids)))
        return False, None


def profile(connector: type[KVConnectorBase]) -> dict[str, Any]:
    """An inline kvwire profile wrapping ``connector`` (vLLM supplies the engine's facts)."""
    return {
        "kv_transfer_config": {
            "kv_connector": connector.__name__,
            "kv_connector_module_path": MODULE,
            "kv_role": "kv_both",
        }
    }
