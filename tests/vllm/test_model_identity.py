"""Models that compute other KV never load each other's blocks from one shared-storage
directory: two models of one shape each given to vLLM as the relative path ``model`` from its
own working directory, a fine-tune and its base, random (``dummy``) weights and the model whose
folder they were given."""

from __future__ import annotations

import logging
import pathlib
import types
from typing import Any

import pytest

import kvwire.vllm
from kvwire.identity.model import LONGEST_IDENTITY
from kvwire.vllm.config_bridge import vllm_model_identity
from tests.support.vllm import (
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


@pytest.fixture(scope="module")
def eight_layer_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """An 8-layer tiny Llama (5.5 MiB of weights) and a fine-tune of it, each saved fresh.

    The fine-tune changes the K projections of layers 0-2, the V projection
    of layer 2 and one norm: tensors in the middle of the file, none of
    which a sample of the file's head, tail and 16 evenly spaced 64 KiB
    pieces reaches.
    """
    import torch
    from transformers import LlamaForCausalLM

    base = build_tiny_llama(tmp_path_factory.mktemp("base") / "model", num_layers=8)
    model = LlamaForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for layer in model.model.layers[:3]:
            layer.self_attn.k_proj.weight.mul_(3.0)
        model.model.layers[2].self_attn.v_proj.weight.mul_(-2.0)
        model.model.layers[0].input_layernorm.weight.mul_(0.5)
    tuned = tmp_path_factory.mktemp("tuned") / "model"
    model.save_pretrained(tuned)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = pathlib.Path(base) / name
        if source.exists():
            (tuned / name).write_bytes(source.read_bytes())
    return base, str(tuned)


@pytest.fixture(scope="module")
def store_with_base_blocks(
    eight_layer_models: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], list[list[int]]]:
    """A shared-storage config whose directory holds the base model's blocks, and its tokens."""
    base, _ = eight_layer_models
    directory = tmp_path_factory.mktemp("store")
    config = kvwire_transfer_config(profile_with_directory("shared-storage.yaml", directory))
    with running_llm(base, config) as llm:
        tokens, _ = generate(llm, PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        assert kvwire.vllm.kvwire_stats(llm)["blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS
    return config, tokens


@pytest.mark.slow
def test_a_fine_tune_changing_tensors_between_any_sample_never_loads_its_base_s_blocks(
    eight_layer_models: tuple[str, str],
    store_with_base_blocks: tuple[dict[str, Any], list[list[int]]],
) -> None:
    _, tuned = eight_layer_models
    config, base_tokens = store_with_base_blocks
    with running_llm(tuned, config) as llm:
        computed, cached = generate(llm, PROMPTS)
        assert kvwire.vllm.kvwire_stats(llm).get("blocks_loaded", 0) == 0
        assert cached == [0] * len(PROMPTS)
        # The fine-tune computes other tokens: its base's blocks would have changed them.
        assert computed != base_tokens
        kvwire.vllm.wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        loaded, cached = generate(llm, PROMPTS)
        assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
        assert loaded == computed


@pytest.mark.slow
def test_dummy_weights_in_the_model_s_folder_never_load_its_blocks(
    eight_layer_models: tuple[str, str],
    store_with_base_blocks: tuple[dict[str, Any], list[list[int]]],
) -> None:
    base, _ = eight_layer_models
    config, _ = store_with_base_blocks
    with running_llm(base, config, load_format="dummy") as llm:
        _, cached = generate(llm, PROMPTS)
        assert kvwire.vllm.kvwire_stats(llm).get("blocks_loaded", 0) == 0
        assert cached == [0] * len(PROMPTS)
        # Its own blocks, in this engine, it loads.
        kvwire.vllm.wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        _, cached = generate(llm, PROMPTS)
        assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)


def identity_config(
    model: str, load_format: str = "auto", engine_id: str = "e1", **fields: Any
) -> Any:
    """The parts of a vLLM config ``vllm_model_identity`` reads."""
    model_fields = {"model": model, "revision": None, "dtype": "float32", "quantization": None}
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(**{**model_fields, **fields}),
        load_config=types.SimpleNamespace(download_dir=None, load_format=load_format),
        kv_transfer_config=types.SimpleNamespace(engine_id=engine_id),
        instance_id="i1",
    )


def test_dummy_weights_are_this_engine_s_alone_and_say_so(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    real = vllm_model_identity(identity_config(tiny_model))
    with caplog.at_level(logging.WARNING, logger="kvwire.vllm.config_bridge"):
        dummy = vllm_model_identity(identity_config(tiny_model, "dummy"))
    assert dummy.startswith("engine-only:") and dummy != real
    assert vllm_model_identity(identity_config(tiny_model, "dummy", engine_id="e2")) != dummy
    # Every process of one engine agrees on it.
    assert vllm_model_identity(identity_config(tiny_model, "dummy")) == dummy
    assert "load_config.load_format is 'dummy'" in caplog.text
    assert "model_config.identity" in caplog.text


def test_dummy_weights_an_operator_names_share_under_that_name_never_with_real_ones(
    tiny_model: str,
) -> None:
    named_dummy = vllm_model_identity(identity_config(tiny_model, "dummy"), "bench-8b")
    assert named_dummy.startswith("explicit:bench-8b;load_format=dummy;")
    assert named_dummy == vllm_model_identity(
        identity_config(tiny_model, "dummy", engine_id="e2"), "bench-8b"
    )
    assert named_dummy != vllm_model_identity(identity_config(tiny_model), "bench-8b")


@pytest.mark.parametrize("load_format", ["tensorizer", "ipc_cache", "modelexpress", "my_loader"])
def test_weights_loaded_from_elsewhere_are_this_engine_s_alone_unless_named(
    tiny_model: str, load_format: str
) -> None:
    assert vllm_model_identity(identity_config(tiny_model, load_format)).startswith("engine-only:")
    named = vllm_model_identity(identity_config(tiny_model, load_format), "acme-8b")
    assert named == vllm_model_identity(identity_config(tiny_model), "acme-8b")


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "SAFETENSORS", "fastsafetensors"])
def test_formats_that_read_the_files_as_they_are_share_the_files_identity(
    tiny_model: str, load_format: str
) -> None:
    assert vllm_model_identity(identity_config(tiny_model, load_format)) == vllm_model_identity(
        identity_config(tiny_model)
    )


def test_weights_kvwire_cannot_read_are_this_engine_s_alone_with_a_warning(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").symlink_to(tmp_path / "gone")
    with caplog.at_level(logging.WARNING, logger="kvwire.vllm.config_bridge"):
        identity = vllm_model_identity(identity_config(str(model)))
    assert identity.startswith("engine-only:")
    assert "cannot read the model's files" in caplog.text
    assert "'model.safetensors'" in caplog.text


def test_what_changes_vllm_s_computation_changes_the_identity(
    tiny_model: str, tmp_path: pathlib.Path
) -> None:
    other_config = tmp_path / "other-config"
    other_config.mkdir()
    (other_config / "config.json").write_text('{"rope_theta": 20000}')
    identities = {
        vllm_model_identity(identity_config(tiny_model, **fields))
        for fields in (
            {},
            {"model_impl": "transformers"},
            {"hf_config_path": str(other_config)},
            {"hf_overrides": {"rope_theta": 20000}},
        )
    }
    assert len(identities) == 4


def test_a_long_identity_is_named_by_its_digest_within_the_field_s_bound(tiny_model: str) -> None:
    long_name = "x" * LONGEST_IDENTITY
    identity = vllm_model_identity(identity_config(tiny_model), long_name)
    assert len(identity) <= LONGEST_IDENTITY
    assert identity.startswith("digest:")
    assert identity != vllm_model_identity(
        identity_config(tiny_model), "x" * (LONGEST_IDENTITY - 1)
    )


def test_longrope_s_long_factors_at_a_long_max_model_len_change_the_identity(
    tiny_model: str,
) -> None:
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 4096}

    def identity(max_model_len: int, parameters: Any = rope) -> str:
        text_config = types.SimpleNamespace(rope_parameters=parameters)
        return vllm_model_identity(
            identity_config(tiny_model, max_model_len=max_model_len, hf_text_config=text_config)
        )

    assert identity(2048) == identity(4096) == vllm_model_identity(identity_config(tiny_model))
    assert identity(8192) != identity(4096)
    assert identity(8192, {"full_attention": rope}) == identity(8192)
    assert identity(8192, {"rope_type": "default"}) == identity(4096)
