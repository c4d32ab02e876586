"""Connectors that break the interface's rules (and one HMA variant), for the engine's tests."""

from __future__ import annotations

import threading
from typing import Any

from kvwire.interface.base import KVConnectorRole, SupportsHMA
from kvwire.interface.types import ForwardContext, Request
from tests.support.directory_connector import BlockTransfer, DirectoryConnector


class NegativeCountConnector(DirectoryConnector):
    """Answers a negative number of matched tokens."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return -4, False


class AsyncZeroConnector(DirectoryConnector):
    """Claims an asynchronous load of zero tokens."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, True


class NeverReceivesConnector(DirectoryConnector):
    """Starts asynchronous loads and never reports them finished."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None


class RoleMixingConnector(DirectoryConnector):
    """Its scheduler side peeks at worker-side state by calling a worker-side method."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.start_load_kv(ForwardContext(layer_names=()))
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class SilentlyCorruptingConnector(DirectoryConnector):
    """Loads every block, then perturbs it and reports nothing: garbage in the cache."""

    def _load(self, transfers: list[BlockTransfer]) -> list[int]:
        failed = super()._load(transfers)
        for transfer in transfers:
            for cache in self._kv_caches:
                cache[:, transfer.block_id] += 0.5
        return failed


class FailingShutdownConnector(DirectoryConnector):
    """Its worker side's shutdown raises."""

    def shutdown(self) -> None:
        super().shutdown()
        if self.role is KVConnectorRole.WORKER:
            raise RuntimeError("the connector's shutdown broke")


class HMADirectoryConnector(DirectoryConnector, SupportsHMA):
    """A well-behaved HMA-capable connector: finishing goes through the all-groups call."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        kept, _params = self.request_finished(request, block_ids[0])
        return kept, {"groups": len(block_ids)}


class HangingSaveConnector(DirectoryConnector):
    """Its worker side's ``wait_for_save`` never returns (a connector stuck on a dead medium)."""

    def wait_for_save(self) -> None:
        threading.Event().wait(600)  # far past any reply deadline of a test


class RankOneFailingConnector(DirectoryConnector):
    """Its worker side on rank 1 (of a parallel engine) raises as the first step starts."""

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._vllm_config.parallel_config.rank == 1:
            raise RuntimeError("rank 1's connector broke")
        super().start_load_kv(forward_context, **kwargs)
