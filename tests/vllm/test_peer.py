"""Disaggregated prefill peer to peer between two vLLM processes: the decode engine (this test's
process) pulls the prompt blocks straight from the live prefill engine's CPU pool over NIXL,
found through the directory on a real redis-server; its tokens equal one engine doing both."""

from __future__ import annotations

import os
import pathlib
import uuid
from typing import Any

import pytest

import kvwire.vllm
from tests.support.vllm import (
    BLOCK_SIZE,
    generate,
    kvwire_transfer_config,
    load_profile_mapping,
    prefill_process,
    running_llm,
    shared_prompts,
    with_redis_url,
    with_small_pools,
)

# NIXL's UCX over loopback, here and in the prefill process (it inherits it).
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

PROMPTS = shared_prompts()
LOADABLE_BLOCKS = (300 - 1) // BLOCK_SIZE


def peer_profile(name: str, redis_url: str, key_prefix: str) -> dict[str, Any]:
    return with_small_pools(with_redis_url(load_profile_mapping(name), redis_url, key_prefix))


@pytest.mark.slow
def test_decode_pulls_the_prompt_blocks_from_the_live_prefill_engine_over_nixl(
    tiny_model: str,
    tokens_without_connector: list[list[int]],
    redis_url: str,
    tmp_path: pathlib.Path,
) -> None:
    key_prefix = f"kvwire:test-{uuid.uuid4().hex[:8]}:"
    producer = peer_profile("peer-prefill.yaml", redis_url, key_prefix)
    consumer = peer_profile("peer-decode.yaml", redis_url, key_prefix)
    with (
        prefill_process(
            tiny_model, kvwire_transfer_config(producer, "kv_producer"), PROMPTS, tmp_path
        ) as produced,
        running_llm(tiny_model, kvwire_transfer_config(consumer, "kv_consumer")) as llm,
    ):
        tokens, cached = generate(llm, PROMPTS)
        consumed = kvwire.vllm.kvwire_stats(llm)

    assert tokens == tokens_without_connector
    assert produced["stats"]["blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS
    # The decode engine computed only each prompt's last block: the rest came from the peer.
    assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
    assert consumed["blocks_loaded"] == consumed["peer_blocks_pulled"]
    assert consumed["peer_blocks_pulled"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert "load_errors" not in consumed
