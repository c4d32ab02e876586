"""kvwire's engine zeroes the blocks of failed loads, whatever connector left what in them.

The conformance kit's fault wrapper stands for a connector kvwire did not
write: it leaves NaN (0xFF bytes) in the block it fails and reports it.
Under ``kv_load_failure_policy: fail`` the request ends and its blocks go
back to the pool unrecomputed, so only the engine's own scrub clears them:
the next step zeroes them, and the request's blocks computed from them,
before anything of it runs.
"""

from __future__ import annotations

import pathlib

import pytest

from kvwire.container import container_for_profile
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.engine.worker import Worker
from kvwire.testing.faults import with_load_faults
from tests.support.engines import generate, tiny_config, tokens
from tests.support.media import shared_storage

PROMPT = tuple((11 * i + 5) % 300 for i in range(40))
STORED = GenerationRequest("stored", PROMPT[:33], 1)
FAILING = GenerationRequest("failing", PROMPT[:37], 1)
NEXT = GenerationRequest("next", PROMPT[1:30], 4)


def nan_blocks(worker: Worker) -> set[int]:
    """Blocks holding a NaN in any layer (the engine's caches start zeroed)."""
    found: set[int] = set()
    for cache in worker.kv_caches.values():
        found |= set(cache.isnan().any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist())
    return found


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_a_failed_loads_block_holds_no_byte_of_it_once_the_engine_steps_again(
    tmp_path: pathlib.Path, load_async: bool
) -> None:
    base = tiny_config()
    reference = tokens(generate(base, [NEXT]))
    generate(shared_storage(base, tmp_path), [STORED])
    failing = shared_storage(base, tmp_path, "fail", async_load=load_async)
    container = with_load_faults(
        container_for_profile(failing), request_ids=frozenset({"failing"}), block_index=-1
    )
    with LLMEngine(failing, container=container) as engine:
        assert isinstance(engine.worker, Worker)
        [failed] = engine.generate([FAILING])
        # Its last step ran after the failure was reported: the scrub's.
        left_by_failure = nan_blocks(engine.worker)
        [after] = engine.generate([NEXT])
        left_after_next = nan_blocks(engine.worker)

    assert failed.error is not None and failed.num_load_failures == 1
    assert left_by_failure == left_after_next == set()
    assert tokens([after]) == reference
