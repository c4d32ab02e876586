"""A complete connector that does nothing, for connector authors' tests to subclass.

A test about one hook overrides just that hook, so the class it defines shows
only the behaviour under test; every abstract call of the base is answered
here the way a connector with nothing to do answers it. It is also the child
or the fake a test puts in a composite or a container override where any
working connector will do.
"""

from __future__ import annotations

from typing import Any

from kvwire.interface.base import KVConnectorBase, KVConnectorMetadata
from kvwire.interface.types import ForwardContext, KVCacheBlocks, Request, SchedulerOutput


class IdleConnector(KVConnectorBase):
    """Matches no tokens, loads and saves nothing, sends empty metadata."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
