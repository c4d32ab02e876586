"""vLLM's start refuses a duration option past its bound, naming it, as `kvwire check` does."""

from __future__ import annotations

import math

import pytest

from kvwire.exceptions import VLLMConfigError
from tests.support.vllm import BLOCK_SIZE, kvwire_transfer_config, load_profile_mapping


@pytest.mark.slow
def test_an_infinite_redis_socket_timeout_fails_vllm_s_configuration_naming_it(
    tiny_model: str,
) -> None:
    from vllm.engine.arg_utils import EngineArgs

    profile = load_profile_mapping("redis.yaml")
    profile["kv_transfer_config"]["kv_connector_extra_config"]["socket_timeout_s"] = math.inf
    args = EngineArgs(
        model=tiny_model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        enforce_eager=True,
        kv_transfer_config=kvwire_transfer_config(profile),
    )

    with pytest.raises(VLLMConfigError) as raised:
        args.create_engine_config()

    assert (
        "kv_connector_extra_config.socket_timeout_s: expected a finite number of seconds > 0 "
        "and <= 3600 (1 hour), got inf"
    ) in str(raised.value)
