"""A bad kvwire profile fails vLLM's configuration, before any engine starts or the model loads."""

from __future__ import annotations

import pathlib
import shutil
import traceback
from typing import Any

import pytest
import yaml

from kvwire.exceptions import VLLMConfigError
from kvwire.vllm.plugin import register
from tests.support.vllm import (
    create_engine_config,
    kvwire_transfer_config,
    load_profile_mapping,
    start_llm,
)


def cpu_offload_with(**extra_config: Any) -> dict[str, Any]:
    profile = load_profile_mapping("cpu-offload.yaml")
    profile["kv_transfer_config"]["kv_connector_extra_config"].update(extra_config)
    return profile


@pytest.mark.slow
def test_an_unknown_medium_fails_llm_before_the_model_is_loaded(
    tiny_model: str, tmp_path: pathlib.Path
) -> None:
    # The model without its weights: an engine that got as far as loading the
    # model would fail there, with vLLM's error about the missing weights.
    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_model, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    config = kvwire_transfer_config(cpu_offload_with(medium="cpu_pol"))

    with pytest.raises(VLLMConfigError) as raised:
        start_llm(str(config_only), config)

    assert str(raised.value).startswith(
        "kv_transfer_config.kv_connector_extra_config.kvwire: kv_connector_extra_config.medium: "
        "unknown medium 'cpu_pol'; expected one of cpu_pool,"
    )
    # Raised from vLLM's create_engine_config, in this process: no engine core was built.
    frames = traceback.extract_tb(raised.value.__traceback__)
    calls = [frame.line for frame in frames if frame.name == "from_engine_args"]
    assert calls == ["vllm_config = engine_args.create_engine_config(usage_context)"]
    assert not [frame for frame in frames if "/v1/engine/core" in frame.filename]


def test_a_profile_file_that_does_not_exist_fails_vllm_s_configuration(
    tiny_model: str, tmp_path: pathlib.Path
) -> None:
    missing = tmp_path / "no-such-profile.yaml"

    with pytest.raises(VLLMConfigError) as raised:
        create_engine_config(tiny_model, kvwire_transfer_config(str(missing)))

    message = str(raised.value)
    assert message.startswith(
        f"kv_transfer_config.kv_connector_extra_config.kvwire_profile ({missing}): "
    )
    assert "cannot read the profile" in message


def test_a_misspelled_key_in_a_profile_file_fails_naming_the_file_and_the_key_it_meant(
    tiny_model: str, tmp_path: pathlib.Path
) -> None:
    profile = load_profile_mapping("cpu-offload.yaml")
    extra = profile["kv_transfer_config"]["kv_connector_extra_config"]
    extra["cpu_pool_byte"] = extra.pop("cpu_pool_bytes")
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(profile))

    with pytest.raises(VLLMConfigError) as raised:
        create_engine_config(tiny_model, kvwire_transfer_config(str(path)))

    assert str(raised.value).startswith(
        f"kv_transfer_config.kv_connector_extra_config.kvwire_profile ({path}): "
        "kv_connector_extra_config.cpu_pool_byte is not an option of CPUOffloadConnector "
        "(did you mean 'cpu_pool_bytes'?); accepted keys are: "
    )


def test_an_unknown_key_of_the_wrapped_connector_fails_vllm_s_configuration_naming_it(
    tiny_model: str,
) -> None:
    config = kvwire_transfer_config(cpu_offload_with(cpu_pool_byte="1GiB"))

    with pytest.raises(VLLMConfigError) as raised:
        create_engine_config(tiny_model, config)

    assert str(raised.value).startswith(
        "kv_transfer_config.kv_connector_extra_config.kvwire: "
        "kv_connector_extra_config.cpu_pool_byte is not an option of CPUOffloadConnector "
        "(did you mean 'cpu_pool_bytes'?); accepted keys are: "
    )


def test_an_unknown_wrapped_connector_fails_vllm_s_configuration_in_vllm_s_words(
    tiny_model: str,
) -> None:
    profile = load_profile_mapping("cpu-offload.yaml")
    profile["kv_transfer_config"]["kv_connector"] = "CPUOfloadConnector"

    with pytest.raises(VLLMConfigError) as raised:
        create_engine_config(tiny_model, kvwire_transfer_config(profile))

    message = str(raised.value)
    assert message.startswith(
        "kv_transfer_config.kv_connector_extra_config.kvwire: kv_transfer_config.kv_connector: "
    )
    assert "Unsupported connector type: CPUOfloadConnector" in message


def test_a_container_hook_s_override_is_what_vllm_s_configuration_is_checked_with(
    tiny_model: str,
) -> None:
    # The hook's connector takes the profile's extra config; an unknown key is
    # still refused through the class the hook put in place.
    config = kvwire_transfer_config(
        cpu_offload_with(cpu_pool_byte="1GiB"),
        kvwire_container_hook="tests.support.vllm:never_hit",
    )

    with pytest.raises(VLLMConfigError, match="not an option of NeverHitCPUOffload"):
        create_engine_config(tiny_model, config)


def test_kvwire_s_plugin_wraps_vllm_s_create_engine_config_once() -> None:
    from vllm.engine.arg_utils import EngineArgs

    register()
    wrapped = EngineArgs.create_engine_config
    register()

    assert EngineArgs.create_engine_config is wrapped
    assert not getattr(wrapped.__wrapped__, "__kvwire_checks_profiles__", False)
