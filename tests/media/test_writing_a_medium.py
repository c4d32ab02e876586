"""The transfer handler docs/writing-a-medium.md builds from the kit runs as written."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvwire.media import BlockTransfer, Counters, JobResult, TransferJob, TransferKind
from tests.support.waits import wait_until

torch = pytest.importorskip("torch")

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-medium.md"
HASHES = tuple(bytes([index]) * 32 for index in range(8))


def _handler_class() -> Any:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    [code] = [block for block in blocks if "class HostCopyHandler(" in block]
    namespace: dict[str, Any] = {"__name__": "writing_a_medium"}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace["HostCopyHandler"]


def _transfer(request_id: str, *block_ids: int) -> BlockTransfer:
    return BlockTransfer(
        request_id=request_id,
        block_ids=block_ids,
        block_hashes=tuple(HASHES[block_id] for block_id in block_ids),
    )


def test_the_documented_handler_saves_and_loads_blocks_and_fails_those_it_never_saved() -> None:
    cache = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    saved = cache.clone()
    counters = Counters()
    handler = _handler_class()(cache, counters)
    try:
        handler.submit(TransferJob(0, TransferKind.SAVE, (_transfer("a", 1, 2, 3),)))
        assert handler.wait([0])
        assert handler.poll() == [JobResult(0)]

        cache.zero_()
        handler.submit(TransferJob(1, TransferKind.LOAD, (_transfer("b", 1, 2, 3, 4),)))
        assert handler.wait([1])

        assert handler.poll() == [JobResult(1, frozenset({4}))]
        assert torch.equal(cache[1:4], saved[1:4])
        assert not cache[4].any()  # never saved: left for the engine to compute
        taken = counters.take()
        assert taken["blocks_saved"] == 3 and taken["blocks_loaded"] == 3
        assert taken["load_errors"] == 1
    finally:
        handler.close()


def test_the_documented_handler_gives_up_on_a_stuck_load_and_writes_nothing_after() -> None:
    cache = torch.ones(4, 2)
    counters = Counters()
    handler = _handler_class()(cache, counters, timeout_s=0.05)
    go_on = threading.Event()

    class Stalled(dict[bytes, Any]):
        def get(self, key: bytes, default: Any = None) -> Any:
            go_on.wait(10)
            return torch.full((2,), 7.0)

    handler.held = Stalled()
    try:
        handler.submit(TransferJob(0, TransferKind.LOAD, (_transfer("a", 0),)))
        started = time.monotonic()
        assert handler.wait([0])
        assert time.monotonic() - started < 5

        assert handler.poll() == [JobResult(0, frozenset({0}))]
        assert counters.take()["load_timeouts"] == 1
        go_on.set()
        wait_until(handler._jobs.idle, "the stalled load to leave its thread")
        assert torch.equal(cache[0], torch.ones(2))  # given up on: it wrote nothing
    finally:
        go_on.set()
        handler.close()


def test_the_documented_handler_releases_a_save_before_its_blocks_are_written() -> None:
    cache = torch.ones(4, 2)
    handler = _handler_class()(cache, Counters())
    go_on = threading.Event()
    try:
        # Hold the save's thread before it starts copying: its piece is then released.
        handler._threads.submit(go_on.wait, 10)
        handler._threads.submit(go_on.wait, 10)
        handler.submit(TransferJob(0, TransferKind.SAVE, (_transfer("a", 2),)))

        released = handler.release_saves_reading(["a"], set())

        assert released == [_transfer("a", 2)]
        assert handler.release_saves_reading(["a"], set()) == []
        go_on.set()
        assert handler.wait([0])
        assert handler.poll() == [JobResult(0)]
        assert HASHES[2] not in handler.held  # it never ran
    finally:
        go_on.set()
        handler.close()
