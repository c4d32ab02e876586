"""The pool's index kept without its KV cache events: the same slots and counts, no events."""

from __future__ import annotations

import random

from kvwire.interface.types import BlockRemoved, BlockStored
from kvwire.media.admission import SaveAdmission
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.eviction import KVFIFOPolicy


def h(n: int) -> bytes:
    return n.to_bytes(8, "big")


def index(*, keep_events: bool) -> CPUPoolIndex:
    return CPUPoolIndex(
        6,
        1,
        "cpu",
        policy=KVFIFOPolicy(6),
        admission=SaveAdmission(2, width=1024),
        keep_events=keep_events,
    )


def test_an_index_without_events_places_and_counts_what_one_with_them_does() -> None:
    rng = random.Random(3)
    with_events, without = index(keep_events=True), index(keep_events=False)
    events = []
    for _ in range(300):
        blocks = [h(rng.randrange(20)) for _ in range(rng.randint(1, 5))]
        corrupt = blocks[:1] if rng.random() < 0.1 else []
        answers = []
        for pool in (with_events, without):
            held = pool.count_held_prefix(0, blocks)
            if held:
                pool.prepare_load(0, blocks[:held])
                pool.complete_load(0, blocks[:held], corrupt[:held])
            placed = pool.prepare_save(0, blocks[held:])
            pool.complete_save(0, [block for block, _ in placed], success=True)
            answers.append((held, placed, pool.take_counters()))
        assert answers[0] == answers[1]
        events.extend(with_events.take_events())
        assert without.take_events() == []
    kinds = {type(event) for event in events}
    assert kinds == {BlockStored, BlockRemoved}
