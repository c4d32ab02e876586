"""The model's identity is of the files vLLM was configured with, which it then loaded.

vLLM's configuration carries each weight file's stamp, taken by kvwire's
config hook before any engine process starts or the model loads; a file that
is no longer the one stamped when its connector digests it (renamed over
after vLLM loaded the old one) gives the engine an identity of its own, with
a warning naming the file: it loads no other engine's blocks. A write the
stamps cannot see (through a live shared mapping) is seen with the digest
cache off (``KVWIRE_DIGEST_CACHE=off``).
"""

from __future__ import annotations

import logging
import mmap
import os
import pathlib
import shutil
import time
import types
from typing import Any

import pytest

import kvwire.vllm
from kvwire.exceptions import VLLMConfigError
from kvwire.identity.file_digests import SETTLE_NS, FileStamp
from kvwire.identity.model import weight_stamps
from kvwire.vllm.config_bridge import vllm_model_identity
from kvwire.vllm.weight_stamps import WEIGHT_STAMPS_KEY, recorded_weight_stamps
from tests.support.vllm import (
    build_tiny_llama,
    create_engine_config,
    generate,
    kvwire_transfer_config,
    profile_with_directory,
    running_llm,
    shared_prompts,
)

PROMPTS = shared_prompts()


@pytest.fixture
def model_copy(tiny_model: str, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(tiny_model, tmp_path / "model"))


@pytest.fixture
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Another tiny Llama's weight file, of the same shape as the tiny model's."""
    other = build_tiny_llama(tmp_path_factory.mktemp("other") / "model", seed=1)
    return pathlib.Path(other) / "model.safetensors"


def rename_over(source: pathlib.Path, target: pathlib.Path) -> None:
    """`source`'s bytes renamed over `target`, as `save_pretrained` or a deploy replaces one."""
    staged = target.with_name(f".{target.name}.new")
    shutil.copyfile(source, staged)
    os.replace(staged, target)


def shared_storage_config(directory: pathlib.Path) -> dict[str, Any]:
    return kvwire_transfer_config(profile_with_directory("shared-storage.yaml", directory))


def test_vllm_s_configuration_carries_the_stamps_of_the_model_s_files(
    model_copy: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    vllm_config = create_engine_config(str(model_copy), shared_storage_config(tmp_path))
    stamps = recorded_weight_stamps(vllm_config)
    assert stamps == weight_stamps(str(model_copy))
    assert "model.safetensors" in stamps


def test_files_unchanged_since_vllm_s_configuration_keep_their_identity(
    model_copy: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    vllm_config = create_engine_config(str(model_copy), shared_storage_config(tmp_path))
    identity = vllm_model_identity(vllm_config)
    assert identity.startswith("weights:")
    del vllm_config.kv_transfer_config.kv_connector_extra_config[WEIGHT_STAMPS_KEY]
    assert vllm_model_identity(vllm_config) == identity


def test_a_weight_file_renamed_over_after_vllm_s_configuration_shares_nothing_with_a_warning(
    model_copy: pathlib.Path,
    other_weights: pathlib.Path,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    vllm_config = create_engine_config(str(model_copy), shared_storage_config(tmp_path))
    rename_over(other_weights, model_copy / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="kvwire.vllm.config_bridge"):
        identity = vllm_model_identity(vllm_config)
    assert identity.startswith("engine-only:")
    assert "the model's file 'model.safetensors'" in caplog.text
    assert "changed after the engine's configuration was built" in caplog.text
    assert "this engine shares KV with no other" in caplog.text


@pytest.mark.parametrize(
    "recorded",
    [["model.safetensors"], {"model.safetensors": [1, 2, 3]}, {"a": [1, 2, 3, 4, "5"]}, {1: None}],
)
def test_weight_stamps_of_another_shape_are_refused_naming_the_key(recorded: object) -> None:
    vllm_config = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_connector_extra_config={WEIGHT_STAMPS_KEY: recorded}
        )
    )
    with pytest.raises(VLLMConfigError, match=rf"kv_connector_extra_config\.{WEIGHT_STAMPS_KEY}"):
        recorded_weight_stamps(vllm_config)


def test_a_bad_kvwire_digest_cache_value_fails_vllm_s_configuration_naming_it(
    model_copy: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVWIRE_DIGEST_CACHE", "disabled")
    with pytest.raises(VLLMConfigError, match="KVWIRE_DIGEST_CACHE: expected 'off'"):
        create_engine_config(str(model_copy), shared_storage_config(tmp_path))


@pytest.mark.slow
def test_weights_renamed_over_after_vllm_loaded_them_share_nothing_and_compute_as_without_kvwire(
    model_copy: pathlib.Path,
    other_weights: pathlib.Path,
    tmp_path: pathlib.Path,
    tokens_without_connector: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    config = shared_storage_config(tmp_path / "store")
    # The other weights' blocks, saved by an engine that computed with them.
    other_model = pathlib.Path(shutil.copytree(model_copy, tmp_path / "other-model"))
    rename_over(other_weights, other_model / "model.safetensors")
    with running_llm(str(other_model), config) as llm:
        generate(llm, PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        assert kvwire.vllm.kvwire_stats(llm)["blocks_saved"] > 0

    load_weights = DefaultModelLoader.load_weights

    def load_then_replace(self: Any, model: Any, model_config: Any) -> None:
        load_weights(self, model, model_config)
        # vLLM holds the old weights; the file now holds the other model's.
        rename_over(other_weights, model_copy / "model.safetensors")

    monkeypatch.setattr(DefaultModelLoader, "load_weights", load_then_replace)
    with (
        caplog.at_level(logging.WARNING, logger="kvwire.vllm.config_bridge"),
        running_llm(str(model_copy), config) as llm,
    ):
        tokens, cached = generate(llm, PROMPTS)
        assert kvwire.vllm.kvwire_stats(llm).get("blocks_loaded", 0) == 0
    assert cached == [0] * len(PROMPTS)
    assert tokens == tokens_without_connector
    assert "the model's file 'model.safetensors'" in caplog.text


@pytest.mark.slow
def test_with_the_digest_cache_off_weights_edited_in_place_through_a_mapping_share_nothing(
    model_copy: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = shared_storage_config(tmp_path / "store")
    weights = model_copy / "model.safetensors"
    # A page in the middle of the tensors, past the safetensors header.
    page = weights.stat().st_size // 2 // mmap.PAGESIZE * mmap.PAGESIZE
    with open(weights, "r+b") as file, mmap.mmap(file.fileno(), 0) as mapping:
        mapping[page] ^= 1
        stamp = FileStamp.of(os.stat(weights))
        # Settled, so that the engine below remembers the digest of these bytes.
        deadline = time.monotonic() + 10
        while time.time_ns() - stamp.ctime_ns < SETTLE_NS and time.monotonic() < deadline:
            time.sleep(0.1)
        with running_llm(str(model_copy), config) as llm:
            generate(llm, PROMPTS)
            kvwire.vllm.wait_for_saves(llm)
            assert kvwire.vllm.kvwire_stats(llm)["blocks_saved"] > 0
        # More writes to a page the mapping has written: no fault, no time updated.
        mapping[page : page + mmap.PAGESIZE] = bytes(mmap.PAGESIZE)
        assert FileStamp.of(os.stat(weights)) == stamp
    with running_llm(str(model_copy)) as llm:
        edited_tokens, _ = generate(llm, PROMPTS)

    monkeypatch.setenv("KVWIRE_DIGEST_CACHE", "off")
    with running_llm(str(model_copy), config) as llm:
        tokens, cached = generate(llm, PROMPTS)
        assert kvwire.vllm.kvwire_stats(llm).get("blocks_loaded", 0) == 0
    assert cached == [0] * len(PROMPTS)
    assert tokens == edited_tokens
