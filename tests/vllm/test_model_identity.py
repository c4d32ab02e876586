"""Two models of one shape, each given to vLLM as the relative path ``model`` from its own
working directory, share one shared-storage directory: neither loads the other's blocks."""

from __future__ import annotations

import pathlib

import pytest

import kvwire.vllm
from tests.support.vllm_engines import (
    BLOCK_SIZE,
    build_tiny_llama,
    generate,
    kvwire_transfer_config,
    profile_with_directory,
    running_llm,
    shared_prompts,
)

PROMPTS = shared_prompts()
LOADABLE_BLOCKS = (300 - 1) // BLOCK_SIZE


@pytest.mark.slow
def test_two_models_named_model_in_two_directories_never_load_each_other_s_blocks(
    tiny_model: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    (first / "model").symlink_to(tiny_model)
    build_tiny_llama(second / "model", seed=1)
    config = kvwire_transfer_config(profile_with_directory("shared-storage.yaml", tmp_path))

    monkeypatch.chdir(first)
    with running_llm("model", config) as llm:
        generate(llm, PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        assert kvwire.vllm.kvwire_stats(llm)["blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS

    monkeypatch.chdir(second)
    with running_llm("model", config) as llm:
        computed, cached = generate(llm, PROMPTS)
        # The first model's blocks are there, under the same block hashes: none is loaded.
        assert kvwire.vllm.kvwire_stats(llm).get("blocks_loaded", 0) == 0
        assert cached == [0] * len(PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        # Its own blocks it does load, and its tokens stay those it computed.
        loaded, cached = generate(llm, PROMPTS)
        assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
        assert loaded == computed
