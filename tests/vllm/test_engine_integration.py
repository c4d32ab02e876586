"""How KVWireConnector meets vLLM's machinery: a container provider overridden inside vLLM,
and kvwire's blocks as vLLM's KV cache events.

vLLM's default multi-process engine with the connector named by kvwire's
plugin entry point alone: tests/vllm/test_hybrid.py, on the hybrid model.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.connectors.offload import CPUOffloadConnector
from kvwire.vllm import wait_for_saves
from tests.support.vllm import (
    BLOCK_SIZE,
    generate,
    kvwire_transfer_config,
    load_profile_mapping,
    running_llm,
    shared_prompts,
)

PROMPTS = shared_prompts()


@pytest.mark.slow
def test_container_hook_overrides_the_connector_class_inside_vllm(
    tiny_model: str, tokens_without_connector: list[list[int]]
) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tests.support.vllm import NeverHitCPUOffload

    config = kvwire_transfer_config(
        load_profile_mapping("cpu-offload.yaml"),
        kvwire_container_hook="tests.support.vllm:never_hit",
    )
    with running_llm(tiny_model, config) as llm:
        generate(llm, PROMPTS)
        wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        worker_connector = get_kv_transfer_group().connector
        warm, cached = generate(llm, PROMPTS)
    assert type(worker_connector) is NeverHitCPUOffload
    assert isinstance(worker_connector, CPUOffloadConnector)
    assert warm == tokens_without_connector
    assert cached == [0] * len(PROMPTS)


class RecordingPublisher:
    """Stands in for vLLM's KV event publisher: keeps every batch."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


@pytest.mark.slow
def test_blocks_kvwire_stored_are_published_as_vllm_block_stored_events(tiny_model: str) -> None:
    from vllm.distributed.kv_events import BlockStored

    publisher = RecordingPublisher()
    with running_llm(tiny_model, kvwire_transfer_config("cpu-offload")) as llm:
        llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher = publisher
        generate(llm, PROMPTS[:1])
        wait_for_saves(llm)
    stored = [e for e in publisher.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    prompt = PROMPTS[0]["prompt_token_ids"]
    full_blocks = [prompt[start : start + BLOCK_SIZE] for start in range(0, 288, BLOCK_SIZE)]
    assert sorted(event.token_ids for event in stored) == sorted(full_blocks)
    assert all(event.block_size == BLOCK_SIZE for event in stored)
