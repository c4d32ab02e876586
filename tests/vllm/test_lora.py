"""LoRA adapters' KV: named by each adapter's weights, so two adapters served at one
relative path never load each other's blocks, and the same adapter does."""

from __future__ import annotations

import json
import logging
import pathlib
import types
from typing import Any

import pytest

import kvwire.vllm
from kvwire.identity.adapter_keys import AdapterKeys, fold_block_hash
from kvwire.identity.file_digests import FileDigests
from kvwire.interface.types import BlockRemoved, BlockStored
from kvwire.vllm.events import BlockTokens
from kvwire.vllm.scheduler_bridge import RequestViews
from tests.support.vllm import (
    BLOCK_SIZE,
    MAX_TOKENS,
    kvwire_transfer_config,
    profile_with_directory,
    running_llm,
    shared_prompts,
)

PROMPTS = shared_prompts()
LOADABLE_BLOCKS = (300 - 1) // BLOCK_SIZE
RANK = 8


def save_adapter(directory: pathlib.Path, seed: int) -> pathlib.Path:
    """A PEFT LoRA adapter of the tiny Llama's K and V projections, drawn from ``seed``."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 16,
        "target_modules": ["k_proj", "v_proj"],
        "bias": "none",
        "base_model_name_or_path": "tiny-llama",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for layer in range(2):
        for projection in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, 128, generator=generator) / 2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(64, RANK, generator=generator) / 2
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def generate_with_adapter(llm: Any, adapter_id: int) -> tuple[list[list[int]], list[int]]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    outputs = llm.generate(
        PROMPTS,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        lora_request=LoRARequest("lora", adapter_id, "lora"),
        use_tqdm=False,
    )
    return (
        [list(output.outputs[0].token_ids) for output in outputs],
        [output.num_cached_tokens for output in outputs],
    )


@pytest.mark.slow
def test_two_adapters_served_at_one_relative_path_never_load_each_other_s_blocks(
    tiny_model: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_adapter(tmp_path / "first" / "lora", seed=1)
    save_adapter(tmp_path / "second" / "lora", seed=2)
    config = kvwire_transfer_config(profile_with_directory("shared-storage.yaml", tmp_path))
    lora = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 1}

    monkeypatch.chdir(tmp_path / "first")
    with running_llm(tiny_model, config, **lora) as llm:
        first_tokens, _ = generate_with_adapter(llm, 1)
        kvwire.vllm.wait_for_saves(llm)
        assert kvwire.vllm.kvwire_stats(llm)["blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS

    monkeypatch.chdir(tmp_path / "second")
    with running_llm(tiny_model, config, **lora) as llm:
        computed, cached = generate_with_adapter(llm, 1)
        # The first adapter's blocks are there, under vLLM's same block hashes: none loads.
        assert kvwire.vllm.kvwire_stats(llm).get("blocks_loaded", 0) == 0
        assert cached == [0] * len(PROMPTS)
        assert computed != first_tokens
        kvwire.vllm.wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        # Its own blocks it does load, and its tokens stay those it computed.
        loaded, cached = generate_with_adapter(llm, 1)
        assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
        assert loaded == computed


def vllm_request(request_id: str, hashes: list[bytes], adapter: Any = None) -> Any:
    return types.SimpleNamespace(request_id=request_id, block_hashes=hashes, lora_request=adapter)


def lora_request(adapter_id: int, path: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest("lora", adapter_id, path)


@pytest.fixture
def views(tmp_path: pathlib.Path) -> RequestViews:
    return RequestViews(AdapterKeys(FileDigests(None)))


def test_a_request_without_an_adapter_keeps_vllm_s_hashes(views: RequestViews) -> None:
    hashes = [b"a" * 32]
    view = views.view(vllm_request("r", hashes))
    assert view.block_hashes is hashes
    assert view.shares


def test_an_adapter_s_request_is_keyed_by_its_adapter_as_vllm_appends_hashes(
    views: RequestViews, tmp_path: pathlib.Path
) -> None:
    adapter = save_adapter(tmp_path / "lora", seed=1)
    hashes = [b"a" * 32]
    request = vllm_request("r", hashes, lora_request(1, str(adapter)))
    view = views.view(request)
    key = AdapterKeys(FileDigests(None)).key(1, "lora", str(adapter))
    assert key is not None
    assert view.block_hashes == [fold_block_hash(key, b"a" * 32)]
    hashes.append(b"b" * 32)
    assert view.block_hashes == [fold_block_hash(key, h) for h in (b"a" * 32, b"b" * 32)]
    # One view per request until it finishes: its key is decided once.
    assert views.view(request) is view
    views.forget("r")
    assert len(views) == 0


def test_an_unidentifiable_adapter_s_request_offers_no_hash(
    views: RequestViews, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvwire.identity.adapter_keys"):
        view = views.view(
            vllm_request("r", [b"a" * 32], lora_request(1, str(tmp_path / "no-such-adapter")))
        )
    assert view.block_hashes == []
    assert not view.shares
    assert "load and save no KV" in caplog.text


def test_an_adapter_s_blocks_are_reported_by_vllm_s_hash_with_the_adapter() -> None:
    tokens = BlockTokens(block_size=2)
    keys = [fold_block_hash(b"k" * 32, block_hash) for block_hash in (b"h0", b"h1")]
    tokens.remember(
        [b"h0", b"h1"], [10, 11, 12, 13], start=0, keys=keys, lora_id=3, lora_name="lora"
    )
    stored, removed = tokens.to_vllm(
        [BlockStored(block_hashes=(keys[1],), medium="cpu"), BlockRemoved((keys[0],), "disk")]
    )
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (
        [b"h1"],
        b"h0",
        [12, 13],
    )
    assert (stored.lora_id, stored.lora_name) == (3, "lora")
    assert removed.block_hashes == [b"h0"]
