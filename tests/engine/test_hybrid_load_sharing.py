"""A request sharing a prefix with a request whose synchronous load fails in the same step.

Request A loads four blocks synchronously and computes two more in the same
step; its load of the sliding-window group's last block fails. Request B,
admitted after A in that step, has A's six blocks as its prefix. Had B
shared them at once, it would compute on (and save) KV derived from the
failed block, while its sliding-window list, null below its window, never
holds the failed block id that the rollback looks for. B waits for the step
instead and then shares what A holds once the load is known sound.
"""

from __future__ import annotations

import pathlib

import attrs
import pytest

from kvwire.config import EngineConfig, LoadFailurePolicy
from kvwire.engine.engine import GenerationRequest, LLMEngine
from tests.support.engines import generate, tiny_hybrid_config, tokens
from tests.support.media import FailAsLastBlock, over_medium, shared_storage

PROMPT = tuple((7 * i + 3) % 300 for i in range(64))
# Blocks of 4: X stores blocks 0..3; A loads them and computes blocks 4 and 5.
STORED = GenerationRequest("X", PROMPT[:17], 1)
A = GenerationRequest("A", PROMPT[:25], 1)
B = GenerationRequest("B", (*PROMPT[:24], 1, 2, 3, 4, 5, 6, 7, 8, 9), 1)


def _failing_a(config: EngineConfig) -> LLMEngine:
    """An engine whose medium fails A's load at its last block (with HMA, a sliding-window one)."""
    return LLMEngine(config, container=over_medium(config, FailAsLastBlock))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("hma", [True, False])
def test_a_request_sharing_a_failed_loads_step_gets_the_tokens_of_running_alone(
    tmp_path: pathlib.Path, hma: bool, policy: LoadFailurePolicy
) -> None:
    base = tiny_hybrid_config(disable_hybrid_kv_cache_manager=not hma)
    reference = tokens(generate(base, [A, B]))
    generate(shared_storage(base, tmp_path), [STORED])
    # Loads only: nothing A computes reaches the store, so B gets A's blocks from A alone.
    consumer = shared_storage(base, tmp_path, policy, "kv_consumer")
    with _failing_a(consumer) as engine:
        assert engine.hma_enabled is hma
        a, b = engine.generate([A, B])
    assert a.num_load_failures == 1
    assert (a.error is not None) is (policy == "fail")
    if policy == "recompute":
        assert a.output_token_ids == reference[0]
    # B never computed on the failed load, so it has nothing to recover from.
    assert b.error is None and b.num_load_failures == 0
    assert b.output_token_ids == reference[1]


def test_no_kv_computed_from_a_failed_load_reaches_the_store(tmp_path: pathlib.Path) -> None:
    base = tiny_hybrid_config()
    reference = tokens(generate(base, [B]))
    storage = shared_storage(base, tmp_path)
    with LLMEngine(storage) as engine:
        engine.generate([STORED])
        engine.wait_for_saves()
    with _failing_a(storage) as engine:
        engine.generate([A, B])
        engine.wait_for_saves()
    with LLMEngine(storage) as engine:
        [warm] = engine.generate([attrs.evolve(B, request_id="B/warm")])
    assert warm.external_tokens == 32  # B's eight blocks, all from the store
    assert tokens([warm]) == reference


def test_no_kv_computed_from_a_failed_load_reaches_the_store_under_the_fail_policy(
    tmp_path: pathlib.Path,
) -> None:
    # Under "fail" A is never computed again, so nothing saved in its step
    # is overwritten: blocks 4 and 5, computed from the garbage, must not be saved.
    base = tiny_hybrid_config()
    reference = tokens(generate(base, [A]))
    generate(shared_storage(base, tmp_path), [STORED])
    with _failing_a(shared_storage(base, tmp_path, "fail")) as engine:
        [failed] = engine.generate([A])
        engine.wait_for_saves()
    assert failed.error is not None
    with LLMEngine(shared_storage(base, tmp_path)) as engine:
        [warm] = engine.generate([attrs.evolve(A, request_id="A/warm")])
    assert tokens([warm]) == reference
