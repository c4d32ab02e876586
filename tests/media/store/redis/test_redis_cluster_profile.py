"""The shipped redis-cluster profile: checked without a cluster, and run against the local one."""

from __future__ import annotations

import attrs
import pytest

from kvwire import cli
from kvwire.config.profile import load_profile
from tests.media.store.redis.test_redis_profiles import CONTAINERS, _pointed_at, _workload
from tests.support.redis import (
    LocalCluster,
    distinct_prompt_blocks,
    generate,
    generate_with_stats,
    tokens,
)

# Each needs the six-process local cluster (about 2 s to start): kept out of the fast loop.
pytestmark = pytest.mark.slow

PROFILE = CONTAINERS / "redis-cluster.yaml"


def test_kvwire_check_validates_the_cluster_profile_without_a_cluster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["check", str(PROFILE)]) == 0

    assert f"profile {PROFILE}: valid" in capsys.readouterr().out


def test_the_cluster_profile_names_a_cluster_url() -> None:
    transfer = load_profile(PROFILE).kv_transfer_config
    assert transfer is not None

    assert transfer.kv_connector == "RedisConnector"
    assert transfer.kv_connector_extra_config["url"].startswith("redis+cluster://")


def test_a_fresh_engine_on_the_cluster_profile_loads_every_prompt_block(
    redis_cluster: LocalCluster, key_prefix: str
) -> None:
    config = _pointed_at(load_profile(PROFILE), redis_cluster.url, key_prefix)
    workload = _workload(config)
    expected = tokens(generate(attrs.evolve(config, kv_transfer_config=None), workload))
    assert tokens(generate(config, workload)) == expected

    outputs, stats = generate_with_stats(config, workload)

    assert tokens(outputs) == expected
    block_size = config.cache_config.block_size
    assert stats["blocks_loaded"] == distinct_prompt_blocks(workload, block_size)
