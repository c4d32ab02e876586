"""JournalConnector: a small connector that writes each request's KV blocks to files.

The scheduler side decides which blocks of which requests to save and says
so in the step's metadata; the worker side copies those blocks out of the
paged KV cache, one file per request and layer. It never loads: it is here
to show the two roles living in two processes, not to be fast.

``kv_connector_extra_config`` keys: ``journal_dir`` (required), the folder.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

from kvwire import (
    EngineConfig,
    KVCacheConfig,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvwire.interface.types import ForwardContext, KVCacheBlocks, Request, SchedulerOutput

if TYPE_CHECKING:
    import torch

ACCEPTED_KEYS = ("journal_dir",)


class JournalMetadata(KVConnectorMetadata):
    """The blocks to save this step: request id -> block ids (crosses processes by pickle)."""

    def __init__(self, saves: dict[str, list[int]]) -> None:
        self.saves = saves


class JournalConnector(KVConnectorBase):
    """Saves every new request's blocks to ``journal_dir/<request>/<layer>.kv``."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        extra = self.kv_transfer_config.kv_connector_extra_config
        for key in extra:
            if key not in ACCEPTED_KEYS:
                raise ValueError(
                    f"kv_connector_extra_config.{key}: unknown key for JournalConnector; "
                    f"accepted keys are {', '.join(ACCEPTED_KEYS)}"
                )
        journal_dir = extra.get("journal_dir")
        if not isinstance(journal_dir, str) or not journal_dir:
            raise ValueError(
                f"kv_connector_extra_config.journal_dir: {journal_dir!r} is not accepted; "
                "expected the path of a folder, as a string"
            )
        self.journal_dir = pathlib.Path(journal_dir)
        self._kv_caches: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        saves = {
            item.request_id: list(item.block_ids[0])
            for item in scheduler_output.scheduled
            if item.is_new
        }
        return JournalMetadata(saves)

    # ---------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass  # this connector never loads

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, JournalMetadata)
        for request_id, block_ids in metadata.saves.items():
            folder = self.journal_dir / request_id
            folder.mkdir(parents=True, exist_ok=True)
            # [2, blocks, block_size, heads, head_size]: keys and values of those blocks.
            blocks = kv_layer[:, block_ids].contiguous()
            (folder / f"{layer_name}.kv").write_bytes(blocks.numpy().tobytes())

    def wait_for_save(self) -> None:
        pass  # saves above are synchronous
