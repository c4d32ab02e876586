"""The conformance kit's load failures: any connector, wrapped, fails its chosen loads as its own.

The wrapper (:mod:`kvwire.testing.faults`) replaces the container's
``connector_class``; these tests check what the kit's failure test alone
would not show: the wrapped connector is told of a synchronous failure
before it saves the step, and the HMA gate answers for the wrapped class.
"""

from __future__ import annotations

import pathlib

import attrs

from kvwire.container import container_for_profile
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.testing.faults import LoadFaultConnector, with_load_faults
from tests.support.engines import (
    generate,
    tiny_config,
    tiny_hybrid_config,
    tokens,
    with_directory_connector,
)
from tests.support.media import shared_storage

PROMPT = tuple((7 * i + 3) % 300 for i in range(64))
# Blocks of 4: X stores blocks 0..3; A loads them and computes blocks 4 and 5.
STORED = GenerationRequest("X", PROMPT[:17], 1)
A = GenerationRequest("A", PROMPT[:25], 1)


def test_blocks_computed_from_a_failed_load_are_not_saved(tmp_path: pathlib.Path) -> None:
    # Under "fail" A is never computed again, so nothing saved in its step is
    # overwritten: blocks 4 and 5, computed from the garbage, must not be saved.
    base = tiny_hybrid_config()
    reference = tokens(generate(base, [A]))
    generate(shared_storage(base, tmp_path), [STORED])
    failing = shared_storage(base, tmp_path, "fail")
    container = with_load_faults(
        container_for_profile(failing), request_ids=frozenset({"A"}), block_index=-1
    )
    with LLMEngine(failing, container=container) as engine:
        assert isinstance(engine.scheduler_connector, LoadFaultConnector)
        [failed] = engine.generate([A])
        engine.wait_for_saves()
    assert failed.error is not None and failed.num_load_failures == 1
    with LLMEngine(shared_storage(base, tmp_path)) as engine:
        [warm] = engine.generate([attrs.evolve(A, request_id="A/warm")])
    assert tokens([warm]) == reference


def test_the_hma_gate_answers_for_the_wrapped_class(tmp_path: pathlib.Path) -> None:
    serves_hma = shared_storage(tiny_hybrid_config(), tmp_path / "storage")
    no_hma = attrs.evolve(
        tiny_hybrid_config(),
        kv_transfer_config=with_directory_connector(
            tiny_config(), tmp_path / "directory"
        ).kv_transfer_config,
    )
    for config, expected in ((serves_hma, True), (no_hma, False)):
        with LLMEngine(config, container=with_load_faults(container_for_profile(config))) as engine:
            assert engine.hma_enabled is expected, engine.hma.reason
            engine.generate([A])
