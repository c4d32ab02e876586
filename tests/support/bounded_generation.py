"""Generating in a vLLM engine by stepping it, with a deadline: an engine that stops finishing
requests fails the test that asked, with what its scheduler holds, instead of hanging it."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from tests.support.vllm_engines import MAX_TOKENS


def generate_within(
    llm: Any,
    prompts: Sequence[Mapping[str, Any]],
    limit_s: float,
    max_tokens: int = MAX_TOKENS,
) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of each prompt and their cached prompt tokens, as ``generate`` returns them.

    Fails (``AssertionError``) when the engine has not finished every request
    ``limit_s`` seconds after they were added, naming how many requests
    wait in each state: those requests are aborted first, so the engine
    can serve the next test.
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    request_ids = [f"bounded-{time.monotonic_ns()}-{index}" for index in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(request_id, dict(prompt), params)
    finished: dict[str, Any] = {}
    deadline = time.monotonic() + limit_s
    steps = 0
    while len(finished) < len(request_ids):
        if time.monotonic() > deadline:
            states = _scheduler_states(engine)
            engine.abort_request([r for r in request_ids if r not in finished])
            _drain(engine, deadline=time.monotonic() + 60)
            raise AssertionError(
                f"{len(request_ids) - len(finished)} of {len(request_ids)} requests not finished "
                f"after {limit_s:g} s ({steps} engine steps); the scheduler held: {states}"
            )
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        steps += 1
    outputs = [finished[request_id] for request_id in request_ids]
    return (
        [list(output.outputs[0].token_ids) for output in outputs],
        [output.num_cached_tokens for output in outputs],
    )


def _scheduler_states(engine: Any) -> dict[str, int]:
    scheduler = engine.engine_core.engine_core.scheduler
    return dict(collections.Counter(r.status.name for r in scheduler.requests.values()))


def _drain(engine: Any, deadline: float) -> None:
    """Step until the aborted requests are gone (their loads end by their own deadline)."""
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()


class _Counting(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__(logging.WARNING)
        self.needle = needle
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.count += 1


@contextmanager
def counting_recoveries() -> Iterator[_Counting]:
    """Counts vLLM's "Recovered from KV load failure" warnings while the block runs."""
    handler = _Counting("Recovered from KV load failure")
    scheduler_logger = logging.getLogger("vllm.v1.core.sched.scheduler")
    scheduler_logger.addHandler(handler)
    try:
        yield handler
    finally:
        scheduler_logger.removeHandler(handler)
