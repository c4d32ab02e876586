"""vLLM's own NixlConnector beside KVWireConnector, as production runs disaggregated prefill:
a prefill engine (NixlConnector, in a process of its own) and a decode engine (this test's
process: vLLM's MultiConnector of NixlConnector and KVWireConnector on CPU offload). The
request's kv_transfer_params go from the prefill engine's output to the decode request, as
vLLM's router does; NIXL reads the prompt's KV over UCX on loopback, kvwire keeps it in its
CPU pool, and a later request for the same prompt is served from there."""

from __future__ import annotations

import os
import pathlib
import socket
from typing import Any

import pytest

import kvwire.vllm
from tests.support.vllm import (
    BLOCK_SIZE,
    MAX_TOKENS,
    generate,
    prefill_process,
    running_llm,
    shared_prompts,
)

# NIXL's UCX over loopback, here and in the prefill process (it inherits it).
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# Three vLLM engines (the session's no-connector one included when this module runs
# alone) take over 300 s to start on two loaded cores.
pytestmark = pytest.mark.timeout(600)

PROMPTS = shared_prompts()
PROMPT_TOKENS = 300
LOADABLE_BLOCKS = (PROMPT_TOKENS - 1) // BLOCK_SIZE
NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
# What a router sends the prefill engine: it is to keep the KV for a remote decode.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
DECODE = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_consumer",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
        "connectors": [
            {**NIXL, "kv_role": "kv_consumer"},
            {
                "kv_connector": "KVWireConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvwire_profile": "cpu-offload"},
            },
        ]
    },
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def side_channel(port: int) -> dict[str, str]:
    """Where an engine's NixlConnector listens for the handshake of the engines reading it."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def prompt_tokens_by_source(llm: Any) -> dict[str, float]:
    """vLLM's own count of prompt tokens by where their KV came from, since the engine started."""
    return {
        metric.labels["source"]: metric.value
        for metric in llm.get_metrics()
        if metric.name == "vllm:prompt_tokens_by_source"
    }


def nixl_bytes_transferred(llm: Any) -> float:
    return float(sum(m.sum for m in llm.get_metrics() if m.name == "vllm:nixl_bytes_transferred"))


def with_params(llm: Any, params: list[dict[str, Any]]) -> list[list[int]]:
    """Greedy tokens of each prompt, its request carrying the prefill engine's transfer params."""
    from vllm import SamplingParams

    sampling = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, extra_args={"kv_transfer_params": p})
        for p in params
    ]
    outputs = llm.generate(PROMPTS, sampling, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.mark.slow
def test_decode_reads_the_prompt_over_nixl_and_kvwire_serves_it_again_later(
    tiny_model: str,
    tokens_without_connector: list[list[int]],
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in side_channel(free_port()).items():
        monkeypatch.setenv(name, value)
    producer = {**NIXL, "kv_role": "kv_producer", "kv_load_failure_policy": "recompute"}
    with running_llm(tiny_model, DECODE, disable_log_stats=False) as llm:
        with prefill_process(
            tiny_model, producer, PROMPTS, tmp_path, REMOTE_DECODE, side_channel(free_port())
        ) as produced:
            tokens = with_params(llm, produced["kv_transfer_params"][0])
            kvwire.vllm.wait_for_saves(llm)
        received = prompt_tokens_by_source(llm)
        moved = nixl_bytes_transferred(llm)
        after_nixl = kvwire.vllm.kvwire_stats(llm)

        # The prefill engine is gone: only kvwire's CPU pool holds the prompts now.
        assert llm.reset_prefix_cache()
        later_tokens, later_cached = generate(llm, PROMPTS)
        later = prompt_tokens_by_source(llm)
        stats = kvwire.vllm.kvwire_stats(llm)

    assert tokens == tokens_without_connector
    # Every prompt token's KV came over NIXL: none computed here.
    assert received.get("external_kv_transfer") == len(PROMPTS) * PROMPT_TOKENS
    assert received.get("local_compute", 0) == 0
    assert moved > 0
    # kvwire saved the KV NIXL delivered, and had nothing to load yet.
    assert after_nixl["blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert "blocks_loaded" not in after_nixl

    assert later_tokens == tokens_without_connector
    assert later_cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
    assert stats["blocks_loaded"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert "load_errors" not in stats
    computed_later = later.get("local_compute", 0) - received.get("local_compute", 0)
    assert computed_later == len(PROMPTS) * (PROMPT_TOKENS - LOADABLE_BLOCKS * BLOCK_SIZE)
