"""`max_load_tokens` in a vLLM request's `kv_transfer_params`: fewer tokens loaded, same outputs."""

from __future__ import annotations

from typing import Any

import pytest

import kvwire.vllm
from tests.support.vllm import (
    BLOCK_SIZE,
    MAX_TOKENS,
    generate,
    kvwire_transfer_config,
    load_profile_mapping,
    running_llm,
    shared_prompts,
)

PROMPTS = shared_prompts()
# A block and a half: loads are whole blocks, so one block is loaded.
MAX_LOAD_TOKENS = BLOCK_SIZE + BLOCK_SIZE // 2


def generate_capped(llm: Any) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of each prompt, its request capped to `MAX_LOAD_TOKENS` loaded tokens."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_args={"kv_transfer_params": {"max_load_tokens": MAX_LOAD_TOKENS}},
    )
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return (
        [list(output.outputs[0].token_ids) for output in outputs],
        [output.num_cached_tokens for output in outputs],
    )


@pytest.mark.slow
def test_a_capped_request_loads_whole_blocks_up_to_its_cap_with_outputs_unchanged(
    tiny_model: str, tokens_without_connector: list[list[int]]
) -> None:
    config = kvwire_transfer_config(load_profile_mapping("cpu-offload.yaml"))
    with running_llm(tiny_model, config) as llm:
        cold, _ = generate(llm, PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        warm, cached = generate_capped(llm)
        stats = kvwire.vllm.kvwire_stats(llm)
    assert cold == tokens_without_connector
    assert warm == tokens_without_connector
    assert cached == [BLOCK_SIZE] * len(PROMPTS)
    assert stats["blocks_loaded"] == len(PROMPTS)
    assert stats["load_blocks_capped"] > 0
