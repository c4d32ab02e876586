"""Redis settings from kv_connector_extra_config: defaults, validation, and secrets kept secret."""

from __future__ import annotations

import logging

import pytest

from kvwire.config import KVTransferConfig
from kvwire.connectors.offload import RedisConnector
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisSettingsError, RedisStoreSettings
from tests.support.connectors import read_options
from tests.support.entries import SMALL_LAYOUT, store_keys
from tests.support.redis import RedisServer


def test_an_empty_extra_config_gives_the_local_server_defaults() -> None:
    settings = RedisStoreSettings.from_extra_config({})

    assert settings == RedisStoreSettings()
    assert settings.url == "redis://127.0.0.1:6379/0"
    assert settings.ttl_seconds is None


def test_every_known_key_is_read() -> None:
    settings = RedisStoreSettings.from_extra_config(
        {
            "url": "redis://cache.internal:6380/2",
            "username": "kv",
            "password": "pw",
            "key_prefix": "prod:",
            "ttl_seconds": 3600,
            "pool_size": 4,
            "socket_timeout_s": 1,
            "connect_timeout_s": 0.5,
            "pipeline_bytes": 1 << 20,
            "lookup_batch_size": 32,
            "retry_interval_s": 2,
            "warning_interval_s": 0,
            "tls_verify": False,
        }
    )

    assert settings.ttl_seconds == 3600
    assert settings.socket_timeout_s == 1.0
    assert isinstance(settings.socket_timeout_s, float)
    assert settings.connection_pool_kwargs()["db"] == 2
    assert settings.connection_pool_kwargs()["host"] == "cache.internal"


def test_the_overall_deadlines_are_read_with_sane_defaults() -> None:
    defaults = RedisStoreSettings.from_extra_config({})
    settings = RedisStoreSettings.from_extra_config(
        {"load_timeout_s": 3, "save_timeout_s": 4.5, "lookup_timeout_s": 0.25}
    )

    assert (defaults.load_timeout_s, defaults.save_timeout_s, defaults.lookup_timeout_s) == (
        20.0,
        30.0,
        1.0,
    )
    assert (settings.load_timeout_s, settings.save_timeout_s, settings.lookup_timeout_s) == (
        3.0,
        4.5,
        0.25,
    )


@pytest.mark.parametrize("name", ["load_timeout_s", "save_timeout_s", "lookup_timeout_s"])
@pytest.mark.parametrize("given", [0, -1, "10", None, True])
def test_a_deadline_that_is_not_a_positive_number_names_the_key(name: str, given: object) -> None:
    with pytest.raises(RedisSettingsError) as raised:
        RedisStoreSettings.from_extra_config({name: given})

    assert f"kv_connector_extra_config.{name}: expected a finite number of seconds > 0" in str(
        raised.value
    )
    assert f"got {given!r}" in str(raised.value)


def test_a_negative_ttl_names_the_key_and_what_is_accepted() -> None:
    with pytest.raises(RedisSettingsError) as raised:
        RedisStoreSettings.from_extra_config({"ttl_seconds": -1})

    assert (
        "kv_connector_extra_config.ttl_seconds: expected a whole number of seconds > 0 and "
        "<= 315360000 (3650 days), restarted by every load, or null for no expiry, got -1"
        in str(raised.value)
    )


@pytest.mark.parametrize(
    ("given", "pipeline_bytes"),
    [("64MiB", 64 * 1024**2), ("2 MB", 2_000_000), ("1.5KiB", 1536), (4096, 4096)],
)
def test_pipeline_bytes_takes_a_size_with_a_unit_like_the_other_sizes(
    given: object, pipeline_bytes: int
) -> None:
    settings = RedisStoreSettings.from_extra_config({"pipeline_bytes": given})

    assert settings.pipeline_bytes == pipeline_bytes


def test_the_connector_reads_a_pipeline_size_with_a_unit() -> None:
    transfer = KVTransferConfig(
        kv_connector="RedisConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"pipeline_bytes": "8MiB", "max_save_bytes_in_flight": "16MiB"},
    )

    _medium, options = read_options(RedisConnector, transfer)
    settings = options["redis_settings"]

    assert settings.pipeline_bytes == 8 * 1024**2


@pytest.mark.parametrize("given", ["64 parsecs", "0MiB", 0, -1, 1.5, True, None])
def test_a_bad_pipeline_size_says_which_forms_are_accepted(given: object) -> None:
    with pytest.raises(RedisSettingsError) as raised:
        RedisStoreSettings.from_extra_config({"pipeline_bytes": given})

    assert (
        "kv_connector_extra_config.pipeline_bytes: expected a byte count per save/load "
        f'pipeline > 0, as an int or a string such as "64MiB", got {given!r}'
    ) in str(raised.value)


def test_every_bad_key_is_reported_at_once() -> None:
    with pytest.raises(RedisSettingsError) as raised:
        RedisStoreSettings.from_extra_config(
            {"pool_size": 0, "socket_timeout_s": "fast", "db": -2, "tls_verify": "yes"}
        )

    message = str(raised.value)
    assert "kv_connector_extra_config.pool_size: expected a whole number of connections" in message
    assert (
        "kv_connector_extra_config.socket_timeout_s: expected a finite number of seconds > 0"
        in message
    )
    assert "kv_connector_extra_config.db: expected a database number >= 0 or null" in message
    assert "kv_connector_extra_config.tls_verify: expected true or false, got 'yes'" in message


def test_a_url_with_another_scheme_is_refused_with_the_accepted_ones() -> None:
    with pytest.raises(
        RedisSettingsError, match=r"scheme must be one of redis://, rediss://, unix://"
    ):
        RedisStoreSettings.from_extra_config({"url": "http://cache:6379"})


def test_a_unix_url_without_a_path_is_refused() -> None:
    with pytest.raises(RedisSettingsError, match="a unix:// URL needs the socket path"):
        RedisStoreSettings.from_extra_config({"url": "unix://"})


def test_a_database_named_in_both_the_url_and_db_is_refused() -> None:
    with pytest.raises(RedisSettingsError, match=r"names a database and so does .*\.db; keep one"):
        RedisStoreSettings.from_extra_config({"url": "redis://h:6379/1", "db": 2})


def test_url_query_options_other_than_db_and_credentials_are_refused() -> None:
    with pytest.raises(RedisSettingsError, match=r"query option\(s\) socket_timeout are not"):
        RedisStoreSettings.from_extra_config({"url": "redis://h:6379/0?socket_timeout=1"})


def test_the_password_can_come_from_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVWIRE_TEST_REDIS_PASSWORD", "from-env")

    settings = RedisStoreSettings.from_extra_config({"password_env": "KVWIRE_TEST_REDIS_PASSWORD"})

    assert settings.password == "from-env"


def test_an_unset_password_variable_is_named_in_the_error() -> None:
    with pytest.raises(
        RedisSettingsError,
        match="password_env: environment variable 'KVWIRE_NO_SUCH_VARIABLE' is not set",
    ):
        RedisStoreSettings.from_extra_config({"password_env": "KVWIRE_NO_SUCH_VARIABLE"})


def test_a_bad_password_value_is_reported_without_echoing_it() -> None:
    with pytest.raises(RedisSettingsError) as raised:
        RedisStoreSettings.from_extra_config({"password": 12345678})

    assert "kv_connector_extra_config.password: expected a string or null, got ***" in str(
        raised.value
    )
    assert "12345678" not in str(raised.value)


def test_passwords_never_appear_in_the_repr_or_the_display_url() -> None:
    settings = RedisStoreSettings(url="redis://kv:url-secret@cache:6379/0", password="key-secret")

    shown = repr(settings) + settings.display_url + repr(RedisBlockStore(settings))

    assert "url-secret" not in shown
    assert "key-secret" not in shown
    assert settings.display_url == "redis://kv:***@cache:6379/0"


def test_a_wrong_password_is_an_outage_whose_warning_does_not_contain_it(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = RedisStoreSettings(
        url=f"redis://nobody:wrong-secret@{redis_server.host}:{redis_server.port}/0",
        retry_interval_s=0.001,
    )
    store = RedisBlockStore(settings)

    with caplog.at_level(logging.WARNING, logger="kvwire.media.store.redis.server"):
        assert store.count_prefix(store_keys(SMALL_LAYOUT, 1)) == 0

    assert not store.is_available
    assert "is unavailable" in caplog.text
    assert "wrong-secret" not in caplog.text
    store.close()


def test_a_missing_tls_file_is_named_before_any_connection() -> None:
    with pytest.raises(
        RedisSettingsError,
        match=r"tls_ca_certs: no file at '/nonexistent/ca.pem'; expected a PEM file",
    ):
        RedisStoreSettings.from_extra_config(
            {"url": "rediss://cache:6380/0", "tls_ca_certs": "/nonexistent/ca.pem"}
        )


def test_tls_files_without_a_rediss_url_are_refused() -> None:
    with pytest.raises(RedisSettingsError, match=r"tls_certfile: only used with a rediss:// url"):
        RedisStoreSettings.from_extra_config(
            {"url": "redis://cache:6379/0", "tls_certfile": "/etc/hostname"}
        )


def test_a_url_whose_password_holds_a_slash_is_refused_without_quoting_it() -> None:
    with pytest.raises(RedisSettingsError) as caught:
        RedisStoreSettings.from_extra_config({"url": "redis://:pa/ss-w0rd@cache:6379/0"})

    assert str(caught.value) == (
        "invalid Redis settings:\n  kv_connector_extra_config.url: the user name or password "
        "holds '/', '?' or '#'; percent-encode them (%2F, %3F, %23), or give the password as "
        "password_env"
    )


def test_a_percent_encoded_slash_in_the_password_is_accepted() -> None:
    settings = RedisStoreSettings.from_extra_config({"url": "redis://:pa%2Fss@cache:6379/0"})

    assert settings.display_url == "redis://:***@cache:6379/0"


def test_a_url_given_as_a_list_is_shown_with_its_password_blanked() -> None:
    with pytest.raises(RedisSettingsError) as caught:
        RedisStoreSettings.from_extra_config({"url": ["redis://:pw-in-a-list@cache/0"]})

    assert str(caught.value).endswith(
        "url: expected a redis://, rediss:// or unix:// URL, or redis+cluster:// "
        "(rediss+cluster://) with a cluster's seed nodes, got ['redis://:***@cache/0']"
    )


def test_a_pipeline_larger_than_the_machine_is_refused_with_the_bytes() -> None:
    with pytest.raises(RedisSettingsError) as caught:
        RedisStoreSettings.from_extra_config({"pipeline_bytes": "100TiB"})

    assert (
        "kv_connector_extra_config.pipeline_bytes: 100.0 TiB (109,951,162,777,600 bytes) would "
        "be held in memory, more than this machine's memory, "
    ) in str(caught.value)
