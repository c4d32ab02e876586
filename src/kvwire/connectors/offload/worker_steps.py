"""What the offload connector's worker half checks and reports each step.

It needs its caches registered and this step's metadata of its own type
before it can move anything (`registered_worker`, `metadata_of_type`),
reports finished requests once their transfers end (`PendingRelease`), and
saves nothing computed from a block whose load failed
(`saves_from_good_context`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.base import metadata_of_type

__all__ = ["PendingRelease", "metadata_of_type", "registered_worker", "saves_from_good_context"]

_Worker = TypeVar("_Worker")


def registered_worker(connector_name: str, worker: _Worker | None) -> _Worker:
    """`worker`, or a `RuntimeError` when `register_kv_caches` has not made one yet."""
    if worker is None:
        raise RuntimeError(
            f"{connector_name}: register_kv_caches() must be called before the first step"
        )
    return worker


class PendingRelease:
    """Finished requests whose blocks stay kept until their transfers end (worker half).

    The scheduler half names them in a step's metadata; the worker half
    reports each as finished sending once no transfer of it runs any more.
    """

    def __init__(self) -> None:
        self._request_ids: set[str] = set()

    def add(self, request_ids: Iterable[str]) -> None:
        self._request_ids.update(request_ids)

    def take_released(self, transfers_running: Callable[[str], bool]) -> set[str]:
        """The requests whose transfers have ended, no longer pending."""
        released = {rid for rid in self._request_ids if not transfers_running(rid)}
        self._request_ids -= released
        return released


def saves_from_good_context(
    saves: Sequence[BlockTransfer], failed_block_ids: set[int]
) -> tuple[list[BlockTransfer], list[BlockTransfer]]:
    """This step's saves split into those to make and those computed from a failed load.

    A synchronous load and the rest of the prompt run in the same step: when
    a block's load fails, the blocks computed after it attended to that
    block's stale cache contents, in the request that loaded it and in any
    request sharing it as a prefix. The engine computes them again (and the
    scheduler half plans their saves then); saved now, they would put wrong
    KV in the store under their hashes, for any later request to load.
    """
    if not failed_block_ids:
        return list(saves), []
    kept: list[BlockTransfer] = []
    left_out: list[BlockTransfer] = []
    for save in saves:
        (kept if failed_block_ids.isdisjoint(save.context_block_ids) else left_out).append(save)
    return kept, left_out
