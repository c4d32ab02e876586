"""How a MultiConnector finishes a request: its children's answers merged, their sends counted.

Any child may keep a finished request's blocks to send them asynchronously;
the engine may free the blocks only once every child that kept them has
reported the request finished sending. The scheduler half counts the keeping
children (`merge_finished_answers`), its step metadata carries how many
reports beyond the first to wait for, and the worker half holds the request
back until they are all in (`FinishedSendingTally`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def merge_finished_answers(
    answers: Iterable[tuple[bool, dict[str, Any] | None]],
) -> tuple[int, dict[str, Any] | None]:
    """How many children keep the blocks, and their `kv_transfer_params` merged.

    The params are None when no child gave any; a key given by two children
    raises vLLM's `Key clash in kv_transfer_params from multiple
    connectors: {keys}` (RuntimeError).
    """
    keeping = 0
    merged: dict[str, Any] | None = None
    for keep, params in answers:
        if keep:
            keeping += 1
        if not params:
            continue
        if merged is None:
            merged = {}
        clash = merged.keys() & params.keys()
        if clash:
            raise RuntimeError(f"Key clash in kv_transfer_params from multiple connectors: {clash}")
        merged.update(params)
    return keeping, merged


class FinishedSendingTally:
    """Worker half: holds a request's finished-sending report until every keeping child sent one."""

    def __init__(self) -> None:
        self._reports_to_skip: dict[str, int] = {}

    def expect(self, extra_async_saves: Iterable[tuple[str, int]]) -> None:
        """The step metadata's `extra_async_saves`: per request, reports beyond the last one."""
        self._reports_to_skip.update(extra_async_saves)

    def is_last_report(self, request_id: str) -> bool:
        """Count a child's report that `request_id` finished sending; True if it was the last."""
        remaining = self._reports_to_skip.get(request_id)
        if remaining is None:
            return True
        if remaining == 1:
            del self._reports_to_skip[request_id]
        else:
            self._reports_to_skip[request_id] = remaining - 1
        return False
