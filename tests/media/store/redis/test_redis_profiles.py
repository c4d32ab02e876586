"""The shipped Redis profiles, pointed at the test server and run in the engine."""

from __future__ import annotations

import pathlib
from typing import Any

import attrs
import pytest
import yaml

from kvwire import cli
from kvwire.config import EngineConfig
from kvwire.config.profile import load_profile
from kvwire.engine.engine import GenerationRequest
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.redis import (
    RedisServer,
    distinct_prompt_blocks,
    generate,
    generate_with_stats,
    tokens,
)

CONTAINERS = pathlib.Path(__file__).resolve().parents[4] / "src" / "kvwire" / "profiles"
REDIS_PROFILES = ("redis.yaml", "tiered-redis.yaml", "disagg-prefill.yaml", "disagg-decode.yaml")


def _pointed_at(config: EngineConfig, url: str, key_prefix: str) -> EngineConfig:
    """The profile's config with every Redis connector (a child too) using the test server."""
    transfer = config.kv_transfer_config
    assert transfer is not None

    def redirect(extra: dict[str, Any], connector: str | None) -> dict[str, Any]:
        if connector == "RedisConnector":
            return {**extra, "url": url, "key_prefix": key_prefix}
        if "tiers" in extra:
            tiers = [
                {**tier, "url": url, "key_prefix": key_prefix}
                if tier["medium"] == "redis"
                else tier
                for tier in extra["tiers"]
            ]
            return {**extra, "tiers": tiers}
        if "connectors" in extra:
            children = [
                {
                    **child,
                    "kv_connector_extra_config": redirect(
                        child.get("kv_connector_extra_config", {}), child["kv_connector"]
                    ),
                }
                for child in extra["connectors"]
            ]
            return {**extra, "connectors": children}
        return extra

    extra = redirect(transfer.kv_connector_extra_config, transfer.kv_connector)
    return attrs.evolve(
        config, kv_transfer_config=attrs.evolve(transfer, kv_connector_extra_config=extra)
    )


def _workload(config: EngineConfig) -> list[GenerationRequest]:
    block_size = config.cache_config.block_size
    spec = WorkloadSpec(
        num_requests=3,
        prompt_len=4 * block_size + 3,
        output_len=4,
        shared_prefix_ratio=0.5,
        vocab_size=config.model_config.vocab_size,
        seed=8,
    )
    return synthetic_workload(spec)


@pytest.mark.parametrize("name", REDIS_PROFILES)
def test_the_profile_loads_and_names_the_redis_connector(name: str) -> None:
    config = load_profile(CONTAINERS / name)

    transfer = config.kv_transfer_config
    assert transfer is not None
    extra = transfer.kv_connector_extra_config
    children = extra.get("connectors", [])
    named = [transfer.kv_connector, *(child["kv_connector"] for child in children)]
    tiers = [tier["medium"] for tier in extra.get("tiers", [])]
    assert "RedisConnector" in named or "redis" in tiers
    assert "password" not in str(transfer.kv_connector_extra_config)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["redis.yaml", "tiered-redis.yaml"])
def test_a_fresh_engine_on_the_profile_loads_from_redis_with_identical_outputs(
    name: str, redis_server: RedisServer, key_prefix: str
) -> None:
    config = _pointed_at(load_profile(CONTAINERS / name), redis_server.url, key_prefix)
    workload = _workload(config)
    expected = tokens(generate(attrs.evolve(config, kv_transfer_config=None), workload))

    assert tokens(generate(config, workload)) == expected
    # A new engine: empty local cache and (tiered) an empty CPU pool, so its
    # hits can only come from Redis.
    outputs, stats = generate_with_stats(config, workload)

    assert tokens(outputs) == expected
    block_size = config.cache_config.block_size
    full_prompt = 4 * block_size  # all of the prompt before its last token
    # The first request loads its whole prompt from Redis; the others share
    # the common prefix it loaded through the local cache and load the rest.
    assert outputs[0].external_tokens == full_prompt
    assert all(
        output.local_cached_tokens + output.external_tokens == full_prompt for output in outputs
    )
    # A tiered connector's Redis counts are its first tier's.
    loaded = stats.get("tier1.blocks_loaded", stats["blocks_loaded"])
    assert loaded == distinct_prompt_blocks(workload, block_size)


def test_kvwire_check_never_prints_the_password(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "with-password.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: RedisConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    url: redis://kv:url-secret-1@cache.internal:6379/0\n"
        "    password: key-secret-2\n"
    )

    assert cli.main(["check", str(profile)]) == 0

    shown = capsys.readouterr()
    assert "RedisConnector" in shown.out
    assert "secret" not in shown.out + shown.err


@pytest.mark.parametrize("as_child", [False, True], ids=["connector", "multi-child"])
def test_kvwire_check_rejects_bad_settings_without_printing_the_password(
    as_child: bool, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    redis: dict[str, Any] = {
        "kv_connector": "RedisConnector",
        "kv_connector_extra_config": {
            "url": "http://kv:url-secret-1@cache.internal:6379/0",
            "password": "key-secret-2",
            "ttl_seconds": -1,
        },
    }
    if as_child:
        redis = {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [redis]},
        }
    profile = tmp_path / "bad-settings.yaml"
    profile.write_text(yaml.safe_dump({"kv_transfer_config": {"kv_role": "kv_both", **redis}}))

    assert cli.main(["check", str(profile)]) == 1

    shown = capsys.readouterr()
    assert "kv_connector_extra_config.ttl_seconds: expected a whole number" in shown.err
    assert "kv_connector_extra_config.url: scheme must be one of" in shown.err
    assert ("connectors[0].kv_connector_extra_config.url" in shown.err) is as_child
    assert "secret" not in shown.out + shown.err
