"""Cluster URLs (redis+cluster://seed,seed): read and validated without connecting."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest

from kvwire.cli import check_profile
from kvwire.config import KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import RedisConnector
from kvwire.media.store.redis._cluster_url import ClusterSeed
from kvwire.media.store.redis.cluster import RedisClusterBlockStore
from kvwire.media.store.redis.settings import RedisSettingsError, RedisStoreSettings
from tests.support.connectors import read_options


def test_a_cluster_url_names_its_seed_nodes_in_order() -> None:
    settings = RedisStoreSettings.from_extra_config(
        {"url": "redis+cluster://10.0.0.1:7000,cache-2.internal:7001"}
    )

    assert settings.is_cluster
    assert settings.cluster_seeds == [
        ClusterSeed("10.0.0.1", 7000),
        ClusterSeed("cache-2.internal", 7001),
    ]


def test_a_single_server_url_is_not_a_cluster() -> None:
    settings = RedisStoreSettings.from_extra_config({"url": "redis://cache:6379/0"})

    assert not settings.is_cluster
    assert settings.cluster_seeds == []


def test_each_node_gets_its_own_url_and_the_cluster_urls_credentials() -> None:
    settings = RedisStoreSettings.from_extra_config(
        {"url": "rediss+cluster://kv:p%40ss@10.0.0.1:7000,10.0.0.2:7000", "tls_verify": False}
    )

    node = settings.node_settings("10.0.0.3", 7002)

    assert node.url == "rediss://10.0.0.3:7002/0"
    assert (node.username, node.password) == ("kv", "p@ss")
    assert not node.is_cluster
    assert node.tls_verify is False


def test_a_seed_without_a_port_is_named_in_the_error() -> None:
    with pytest.raises(RedisSettingsError, match=r"url: seed 'cache-2' must be host:port"):
        RedisStoreSettings.from_extra_config({"url": "redis+cluster://cache-1:7000,cache-2"})


def test_a_seed_with_a_bad_port_is_named_with_the_accepted_range() -> None:
    with pytest.raises(RedisSettingsError, match=r"seed 'c:99999': the port must be a number"):
        RedisStoreSettings.from_extra_config({"url": "redis+cluster://c:99999"})


def test_a_cluster_url_without_seeds_shows_an_example() -> None:
    with pytest.raises(RedisSettingsError, match=r"url: no seed node, e.g. redis\+cluster://"):
        RedisStoreSettings.from_extra_config({"url": "redis+cluster://"})


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"url": "redis+cluster://c:7000/2"}, id="database-in-the-path"),
        pytest.param({"url": "redis+cluster://c:7000", "db": 1}, id="db-key"),
    ],
)
def test_a_cluster_refuses_any_database_but_0(extra: dict[str, object]) -> None:
    with pytest.raises(RedisSettingsError, match=r"a cluster has only database 0"):
        RedisStoreSettings.from_extra_config(extra)


def test_a_key_prefix_with_a_hash_tag_is_refused_on_a_cluster() -> None:
    with pytest.raises(RedisSettingsError, match=r"key_prefix: a \{hash tag\} would put every"):
        RedisStoreSettings.from_extra_config(
            {"url": "redis+cluster://c:7000", "key_prefix": "kv:{fleet}:"}
        )


def test_braces_that_are_no_hash_tag_are_accepted_on_a_cluster() -> None:
    # An empty {} is no hash tag: Redis Cluster then hashes the whole key.
    settings = RedisStoreSettings.from_extra_config(
        {"url": "redis+cluster://c:7000", "key_prefix": "kv:{}:"}
    )

    assert settings.key_prefix == "kv:{}:"


def test_tls_files_are_accepted_only_with_a_rediss_cluster_url() -> None:
    with pytest.raises(RedisSettingsError, match=r"tls_ca_certs: only used with a rediss://"):
        RedisStoreSettings.from_extra_config(
            {"url": "redis+cluster://c:7000", "tls_ca_certs": "/etc/ca.pem"}
        )


def test_the_cluster_password_is_blanked_in_the_display_url() -> None:
    settings = RedisStoreSettings.from_extra_config(
        {"url": "redis+cluster://kv:hunter2@c1:7000,c2:7000"}
    )

    assert "hunter2" not in settings.display_url
    assert "hunter2" not in repr(settings)


def test_the_connector_checks_a_cluster_url_without_connecting() -> None:
    # Port 1 on a name that does not resolve: only validation can pass or fail here.
    config = KVTransferConfig(
        kv_connector="RedisConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"url": "redis+cluster://nowhere.invalid:1,nowhere.invalid:2"},
    )

    _medium, options = read_options(RedisConnector, config)

    assert options["redis_settings"].is_cluster


def test_the_connector_names_the_key_of_a_bad_cluster_url() -> None:
    config = KVTransferConfig(
        kv_connector="RedisConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"url": "redis+cluster://c:7000?socket_timeout=1"},
    )

    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.url: a cluster URL"):
        read_options(RedisConnector, config)


@pytest.mark.parametrize("port", ["²", "٣٠٠٠"])
def test_a_seed_port_in_other_than_ascii_digits_is_refused_by_name(port: str) -> None:
    with pytest.raises(RedisSettingsError) as raised:
        RedisStoreSettings.from_extra_config({"url": f"redis+cluster://10.0.0.1:{port}"})

    assert "the port must be a number between 1 and 65535" in str(raised.value)
    assert "kv_connector_extra_config.url" in str(raised.value)


@pytest.mark.parametrize("separator", ["/", "?", "#"])
def test_a_password_with_an_unencoded_url_separator_is_refused_without_quoting_it(
    separator: str,
) -> None:
    url = f"redis+cluster://kv:first-half{separator}second-half@10.0.0.1:7000"

    with pytest.raises(RedisSettingsError) as raised:
        RedisStoreSettings.from_extra_config({"url": url})

    message = str(raised.value)
    assert "percent-encode" in message and "kv_connector_extra_config.url" in message
    assert "half" not in message


def many_seeds_settings() -> RedisStoreSettings:
    # Ports nothing listens on: every seed refuses at once.
    seeds = ",".join(f"127.0.0.1:{port}" for port in range(2, 302))
    return RedisStoreSettings.from_extra_config(
        {"url": f"redis+cluster://kv:hunter2@{seeds}", "connect_timeout_s": 0.1}
    )


def test_settings_with_hundreds_of_seeds_have_a_bounded_repr() -> None:
    shown_settings = repr(many_seeds_settings())

    assert len(shown_settings) < 1000
    assert "hunter2" not in shown_settings


def test_a_store_with_hundreds_of_seeds_warns_and_shows_itself_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        store = RedisClusterBlockStore(many_seeds_settings())
    try:
        assert "no slot map" in caplog.text
        assert max(len(record.getMessage()) for record in caplog.records) < 1000
        assert len(repr(store)) < 300
    finally:
        store.close()


@pytest.mark.parametrize(
    ("seed", "problem"),
    [
        ("[::1:2", r"seed '\[::1:2' opens an IPv6 address with '\[' and never closes it"),
        ("[nonsense]:7000", r"seed '\[nonsense\]:7000' holds no IPv6 address"),
        ("[::1]7000", r"seed '\[::1\]7000' must be \[IPv6 address\]:port"),
        ("::1:7000", r"seed '::1:7000' is an IPv6 address without brackets"),
        ("ca che:7000", r"seed 'ca che:7000' must be host:port, the host a name or an IPv4"),
        ("[::1]:0", r"seed '\[::1\]:0': the port must be a number between 1 and 65535"),
    ],
)
def test_every_seed_of_the_list_is_parsed_and_a_malformed_one_named(
    seed: str, problem: str
) -> None:
    url = f"redis+cluster://:hunter2-secret@127.0.0.1:27101,{seed}"
    with pytest.raises(
        RedisSettingsError, match=rf"kv_connector_extra_config\.url: {problem}"
    ) as e:
        RedisStoreSettings.from_extra_config({"url": url})
    assert "hunter2" not in str(e.value)


def test_an_ipv6_seed_in_brackets_is_a_seed() -> None:
    settings = RedisStoreSettings.from_extra_config({"url": "redis+cluster://[::1]:7000,h:7001"})
    assert settings.cluster_seeds == [ClusterSeed("::1", 7000), ClusterSeed("h", 7001)]


def test_credentials_after_the_first_seed_are_refused_saying_where_they_go() -> None:
    url = "redis+cluster://127.0.0.1:1,u:hunter2-secret@127.0.0.1:27101"
    where = r"url: the credentials go once, right after the scheme and before the first seed"
    with pytest.raises(RedisSettingsError, match=where + r" \(user:password@host:port") as e:
        RedisStoreSettings.from_extra_config({"url": url})
    message = str(e.value)
    assert "hunter2" not in message and "127.0.0.1:1" not in message


def test_a_comma_in_a_cluster_password_is_percent_encoded_and_given_to_each_node() -> None:
    settings = RedisStoreSettings.from_extra_config({"url": "redis+cluster://u:p%2Cw@h:1,g:2"})
    assert settings.cluster_seeds == [ClusterSeed("h", 1), ClusterSeed("g", 2)]
    node = settings.node_settings("g", 2)
    assert (node.username, node.password) == ("u", "p,w")
    assert "p,w" not in settings.display_url and "p%2Cw" not in settings.display_url


@pytest.mark.parametrize(
    "url",
    ["redis+cluster://:hunter2-secret@127.0.0.1:27101,[::1:2", "redis://:hunter2-secret@[::1:2/0"],
)
def test_kvwire_check_refuses_a_malformed_host_naming_the_url_key(url: str, tmp_path: Any) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "kv_transfer_config:\n  kv_connector: RedisConnector\n  kv_role: kv_both\n"
        f"  kv_connector_extra_config:\n    url: '{url}'\n"
    )
    err = io.StringIO()
    assert check_profile(str(profile), out=io.StringIO(), err=err) == 1
    assert "kv_connector_extra_config.url: " in err.getvalue()
    assert "IPv6" in err.getvalue()
    assert "hunter2" not in err.getvalue()
