"""kvwire's engine over a medium whose every load fails: each request's load fails once at
most, however often it is looked up again, and the medium's hits are then withheld."""

from __future__ import annotations

import pathlib

import pytest

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine
from tests.support.engines import generate, renamed, served, tiny_config, tokens
from tests.support.media import FailEveryLoad, over_medium, shared_storage

Workload = list[GenerationRequest]


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_a_request_looked_up_again_after_preemption_is_not_offered_its_failed_load_again(
    workload: Workload, tmp_path: pathlib.Path, load_async: bool
) -> None:
    # 24 blocks: requests are preempted, and looked up again when resumed.
    small = tiny_config(num_gpu_blocks=24)
    reference = tokens(generate(small, workload))
    connector_config = shared_storage(
        small, tmp_path, async_load=load_async, load_failures_to_pause=1000
    )
    generate(connector_config, workload)
    container = over_medium(connector_config, FailEveryLoad)
    with LLMEngine(connector_config, container=container) as engine:
        warm = engine.generate(workload)
        assert engine.counters.preemptions > 0
    assert tokens(warm) == reference
    assert {output.num_load_failures for output in warm} <= {0, 1}
    assert sum(output.num_load_failures for output in warm) > 0


def test_a_medium_whose_loads_keep_failing_is_not_offered_until_its_pause_ends(
    config: EngineConfig, workload: Workload, tmp_path: pathlib.Path
) -> None:
    reference = tokens(generate(config, workload))
    connector_config = shared_storage(
        config, tmp_path, async_load=True, load_failures_to_pause=2, load_pause_s=600
    )
    generate(connector_config, workload)
    container = over_medium(connector_config, FailEveryLoad)
    with LLMEngine(connector_config, container=container) as engine:
        failing = engine.generate(renamed(workload, "-failing"))
        engine.wait_for_saves()
        assert engine.reset_prefix_cache()  # the next requests ask the medium again
        withheld = engine.generate(renamed(workload, "-withheld"))
    assert tokens(failing) == tokens(withheld) == reference
    assert sum(output.num_load_failures for output in failing) >= 2
    assert sum(output.num_load_failures for output in withheld) == 0
    assert served(withheld) == 0
