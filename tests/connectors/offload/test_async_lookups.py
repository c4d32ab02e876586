"""`async_lookup`: a slow medium is looked up on a lookup thread, never on the scheduler's.

The lookup answers None ("ask again later") until the thread has answered,
then the count; past its deadline, a miss. Through the engine (alone and
under a `MultiConnector`), outputs equal outputs without a connector.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest

from kvwire.blocks.groups import CacheGroup
from kvwire.config import EngineConfig
from kvwire.connectors.offload._async_lookups import AsyncLookups, LookupAnswers
from kvwire.connectors.offload._planner import BlockPlanner
from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
from kvwire.engine.engine import LLMEngine, RequestOutput
from kvwire.interface.types import BlockHash, Request, SchedulerOutput
from kvwire.media.base import MediumIndex
from tests.support.engines import (
    generate,
    served,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.stores import DictMedium, DictStore

BLOCK = 4
HASHES = [bytes([n]) * 8 for n in range(4)]
# Long enough never to pass in a test that means the answer to arrive first.
NO_DEADLINE_S = 600.0


def request_of(request_id: str = "r") -> Request:
    """A prompt of four full blocks and one token more."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(4 * BLOCK + 1)),
        max_tokens=1,
        block_hashes=list(HASHES),
    )


class GatedIndex(MediumIndex):
    """Holds `held` blocks; each lookup waits until `release` is set."""

    concurrent_lookups = True

    def __init__(self, held: int) -> None:
        self.held = held
        self.release = threading.Event()
        self.asked: list[tuple[int, tuple[BlockHash, ...]]] = []

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        # Bounded: a lookup made on the scheduler's thread returns a count
        # (the test then fails) instead of hanging the run.
        self.release.wait(timeout=30)
        self.asked.append((group, tuple(block_hashes)))
        return min(self.held, len(block_hashes))


def scheduler_half(index: MediumIndex, deadline_s: float | None) -> OffloadSchedulerHalf:
    planner = BlockPlanner(BLOCK, [CacheGroup(0, ("layers.0",), BLOCK)], loads=True, saves=True)
    return OffloadSchedulerHalf(
        index=index, planner=planner, num_groups=1, async_load=False, lookup_deadline_s=deadline_s
    )


def answer_when_in(half: OffloadSchedulerHalf, request: Request) -> tuple[int | None, bool]:
    """Ask again, as the engine does each step, until the lookup thread has answered."""
    for _ in range(6000):
        answer = half.get_num_new_matched_tokens(request, 0)
        if answer[0] is not None:
            return answer
        time.sleep(0.005)
    raise AssertionError("the lookup was never answered")


def counters(half: OffloadSchedulerHalf) -> dict[str, int]:
    metadata = half.build_connector_meta(SchedulerOutput(scheduled=[]))
    return dict(metadata.counters)


def test_a_blocked_lookup_answers_none_at_once_then_the_count_once_released() -> None:
    index = GatedIndex(held=3)
    half = scheduler_half(index, NO_DEADLINE_S)
    request = request_of()
    try:
        assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        index.release.set()
        assert answer_when_in(half, request) == (3 * BLOCK, False)
        # Answered from what the thread asked: the index was asked once.
        assert index.asked == [(0, tuple(HASHES))]
        assert counters(half) == {"lookups_started": 1, "lookups_settled": 1}
    finally:
        index.release.set()
        half.close()


def test_a_lookup_past_its_deadline_is_a_miss() -> None:
    index = GatedIndex(held=3)
    half = scheduler_half(index, 0.001)
    request = request_of()
    try:
        assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        time.sleep(0.01)  # past the deadline; the index is still blocked
        assert half.get_num_new_matched_tokens(request, 0) == (0, False)
        assert counters(half)["lookups_late"] == 1
    finally:
        index.release.set()
        half.close()


def test_a_question_the_thread_did_not_ask_is_a_miss() -> None:
    index = GatedIndex(held=4)
    index.release.set()
    half = scheduler_half(index, NO_DEADLINE_S)
    request = request_of()
    try:
        assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        # The local hit grew meanwhile: the planner asks about other hashes.
        for _ in range(6000):
            answer = half.get_num_new_matched_tokens(request, BLOCK)
            if answer[0] is not None:
                break
            time.sleep(0.005)
        assert answer == (0, False)
    finally:
        half.close()


def test_a_request_freed_while_its_lookup_is_in_flight_leaves_nothing_behind() -> None:
    index = GatedIndex(held=3)
    half = scheduler_half(index, NO_DEADLINE_S)
    request = request_of()
    try:
        assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        assert half.request_finished(request) is False
        index.release.set()
        assert counters(half) == {"lookups_started": 1, "lookups_settled": 1}
        # Nothing kept: the same id starts a lookup of its own.
        assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        assert answer_when_in(half, request) == (3 * BLOCK, False)
    finally:
        index.release.set()
        half.close()


class SchedulerThreadIndex(GatedIndex):
    """An index whose lookups must stay on the scheduler's thread."""

    concurrent_lookups = False


def test_an_index_without_concurrent_lookups_answers_at_once() -> None:
    index = SchedulerThreadIndex(held=2)
    index.release.set()
    half = scheduler_half(index, NO_DEADLINE_S)
    try:
        assert half.get_num_new_matched_tokens(request_of(), 0) == (2 * BLOCK, False)
    finally:
        half.close()


# Through the engine: a plug-in store whose lookups are slow.


class SlowStore(DictStore):
    """A store whose lookups wait `delay_s` each, as a Redis far away does."""

    entries: ClassVar[dict[str, bytes]] = {}
    delay_s = 0.005

    def count_prefix(self, keys: Sequence[str]) -> int:
        time.sleep(self.delay_s)
        return super().count_prefix(keys)


class SlowMedium(DictMedium):
    store_class = SlowStore


@pytest.fixture(autouse=True)
def _empty_store() -> Iterator[None]:
    SlowStore.entries.clear()
    yield
    SlowStore.entries.clear()


SLOW_MEDIUM = f"{SlowMedium.__module__}:{SlowMedium.__name__}"


def slow_store_options(**extra: Any) -> dict[str, Any]:
    return {"medium": SLOW_MEDIUM, "async_lookup": True, **extra}


def run(config: EngineConfig) -> tuple[list[RequestOutput], dict[str, Any]]:
    with LLMEngine(config) as engine:
        outputs = engine.generate(workload())
    return outputs, engine.connector_stats.reduce()


def test_the_engine_with_a_slow_store_and_async_lookup_keeps_its_outputs() -> None:
    reference = tokens(generate(tiny_config(), workload()))
    config = with_connector(
        tiny_config(), "OffloadConnector", slow_store_options(lookup_deadline_s=NO_DEADLINE_S)
    )
    cold, _ = run(config)
    warm, warm_stats = run(config)
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    assert served(warm) > 0
    assert warm_stats["lookups_started"] == warm_stats["lookups_settled"] > 0


def test_a_multi_connector_passes_a_pending_lookup_through() -> None:
    reference = tokens(generate(tiny_config(), workload()))
    children = [
        {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_extra_config": {"cpu_pool_bytes": "8MiB"},
        },
        {
            "kv_connector": "OffloadConnector",
            "kv_connector_extra_config": slow_store_options(lookup_deadline_s=NO_DEADLINE_S),
        },
    ]
    config = with_connector(tiny_config(), "MultiConnector", {"connectors": children})
    generate(config, workload())  # fills the store
    warm, stats = run(config)  # a fresh engine: its CPU pool is empty
    assert tokens(warm) == reference
    # Had the MultiConnector taken None for a miss, the store would serve nothing.
    assert stats["OffloadConnector"]["blocks_loaded"] > 0
    assert stats["OffloadConnector"]["lookups_started"] > 0


def test_a_lookup_whose_probe_raised_is_a_miss_not_an_error_of_the_scheduler() -> None:
    def probe(span: object, count: object) -> None:
        raise RuntimeError("the planner failed")

    lookups = AsyncLookups(probe, lambda group, hashes: 0, deadline_s=NO_DEADLINE_S)
    span = object()
    try:
        assert lookups.answers("r", span) is None  # type: ignore[arg-type]
        for _ in range(6000):
            answer = lookups.answers("r", span)  # type: ignore[arg-type]
            if answer is not None:
                break
            time.sleep(0.005)
        assert answer == LookupAnswers({})
        assert lookups.in_flight == 0
    finally:
        lookups.close()
