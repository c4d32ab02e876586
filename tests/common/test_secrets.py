"""Secrets stay secret: no error, repr, log line or ``kvwire check`` output shows one.

Each test plants ``SECRET`` where a user could put a password and greps
everything shown for it. The fuzzer in ``test_secrets_fuzz.py`` does the same
over many forms; these name the paths that once leaked.
"""

from __future__ import annotations

import io
import logging
import pathlib

import pytest

from kvwire.cli import check_profile, main
from kvwire.common.redaction import (
    RedactingFilter,
    is_secret_key,
    redact_text,
    secret_values,
    shown,
)
from kvwire.config import KVTransferConfig
from kvwire.config.profile import load_profile
from kvwire.exceptions import ProfileError

SECRET = "hunter2-S3CR3T"


def check_output(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    check_profile(str(path), out=out, err=err)
    return out.getvalue() + err.getvalue()


def redis_profile(extra_config_lines: str) -> str:
    return (
        "kv_transfer_config:\n"
        "  kv_connector: RedisConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n" + extra_config_lines
    )


def test_a_password_beside_a_non_string_key_is_not_shown(tmp_path: pathlib.Path) -> None:
    output = check_output(tmp_path, redis_profile(f"    password: {SECRET}\n    1: x\n"))

    assert "is not a mapping with string keys" in output
    assert SECRET not in output


@pytest.mark.torch
def test_a_url_whose_password_holds_a_slash_is_refused_without_showing_it(
    tmp_path: pathlib.Path,
) -> None:
    output = check_output(tmp_path, redis_profile(f'    url: "redis://:ab/{SECRET}@h:6379/0"\n'))

    assert "percent-encode" in output
    assert SECRET not in output


@pytest.mark.torch
def test_a_url_given_as_a_list_is_refused_without_its_password(tmp_path: pathlib.Path) -> None:
    output = check_output(tmp_path, redis_profile(f'    url: ["redis://:{SECRET}@h:6379/0"]\n'))

    assert "kv_connector_extra_config.url: expected a redis://" in output
    assert SECRET not in output


def test_a_yaml_error_on_the_password_line_does_not_quote_it(tmp_path: pathlib.Path) -> None:
    output = check_output(tmp_path, redis_profile(f'    password: "{SECRET}\n    url: x\n'))

    assert "not valid YAML: line 7, column 1" in output
    assert SECRET not in output


def test_an_undefined_alias_named_like_the_password_is_not_quoted(
    tmp_path: pathlib.Path,
) -> None:
    output = check_output(tmp_path, redis_profile(f"    password: *{SECRET}\n"))

    assert "found undefined alias" in output
    assert SECRET not in output


def test_the_repr_of_a_kv_transfer_config_blanks_the_password() -> None:
    config = KVTransferConfig(
        kv_connector="RedisConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"password": SECRET, "url": f"redis://u:{SECRET}@h/0"},
    )

    assert SECRET not in repr(config)
    assert "'password': '***'" in repr(config)
    assert "redis://u:***@h/0" in repr(config)


def test_the_repr_of_an_engine_config_blanks_a_childs_password() -> None:
    child = {"kv_connector": "RedisConnector", "kv_connector_extra_config": {"password": SECRET}}
    engine_config = load_profile(
        {
            "kv_transfer_config": {
                "kv_connector": "MultiConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"connectors": [child]},
            }
        }
    )

    assert SECRET not in repr(engine_config)


def test_a_password_in_a_field_of_the_wrong_type_is_not_shown() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile({"kv_transfer_config": {"kv_ip": {"password": SECRET}}})

    assert caught.value.problems == (
        "kv_transfer_config.kv_ip: {'password': '***'} is not a string",
    )


def test_a_child_with_a_field_of_the_wrong_type_shows_its_type_only(
    tmp_path: pathlib.Path,
) -> None:
    output = check_output(
        tmp_path,
        "kv_transfer_config:\n"
        "  kv_connector: MultiConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    connectors:\n"
        f"    - {{kv_connector: RedisConnector, kv_ip: [{SECRET}]}}\n",
    )

    assert "connectors[0]: kv_ip must be a string, got a list" in output
    assert SECRET not in output


@pytest.mark.torch
def test_a_plugin_error_quoting_the_password_is_scrubbed_by_check(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvwire.connectors.offload import RedisConnector

    def quoting(cls: type, kv_transfer_config: KVTransferConfig, resolve: object) -> None:
        extra = kv_transfer_config.kv_connector_extra_config
        raise ValueError(f"cannot log in with {extra['password']}")

    monkeypatch.setattr(RedisConnector, "validate_extra_config", classmethod(quoting))

    output = check_output(tmp_path, redis_profile(f"    password: {SECRET}\n"))

    assert output.endswith("error: cannot log in with ***\n")


def test_the_log_filter_blanks_url_credentials_and_named_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("kvwire.test_secrets")
    caplog.handler.addFilter(RedactingFilter())

    logger.warning("connecting to %s with password=%s", f"redis://:{SECRET}@h", SECRET)

    assert SECRET not in caplog.text
    assert "redis://:***@h with password=***" in caplog.text


def test_the_command_line_puts_its_log_handlers_behind_the_filter(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text("cache_config: {block_size: 8}\n")
    main(["check", str(profile)])

    logging.getLogger("kvwire.test_secrets").warning("reconnecting to redis://:%s@h", SECRET)

    assert "reconnecting to redis://:***@h" in caplog.text


@pytest.mark.parametrize(
    "name", ["password", "redis_password", "token", "api_token", "secret", "Client-Secret"]
)
def test_secret_like_key_names_are_recognised(name: str) -> None:
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["password_env", "username", "url", "key_prefix", "tls_keyfile"])
def test_other_key_names_are_not_secrets(name: str) -> None:
    assert not is_secret_key(name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("redis://user:pw@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:pw/with/slashes@host", "redis://:***@host"),
        ("https://TOKEN@github.com/x", "https://***@github.com/x"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("url?db=1&password=pw&x=1", "url?db=1&password=***&x=1"),
        ('password: "pw"', 'password: "***"'),
        ("password_env: KVWIRE_PW", "password_env: KVWIRE_PW"),
    ],
)
def test_redact_text_blanks_credentials_and_keeps_the_rest(text: str, expected: str) -> None:
    assert redact_text(text) == expected


def test_secret_values_finds_passwords_by_key_in_urls_and_through_password_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVWIRE_TEST_PASSWORD", "from-the-environment")
    profile = {
        "password": "by-key-name",
        "connectors": [{"url": "redis://:in-a-url@h"}, {"password_env": "KVWIRE_TEST_PASSWORD"}],
    }

    assert secret_values(profile) == {"by-key-name", "in-a-url", "from-the-environment"}


def test_secret_values_finds_a_percent_encoded_url_password_as_typed_and_as_decoded() -> None:
    # Redis is given the decoded password: an error may quote either form.
    profile = {"url": "redis+cluster://kv:p%40ss%2Fw0rd@h1:7000,h2:7000"}

    assert secret_values(profile) == {"p%40ss%2Fw0rd", "p@ss/w0rd"}


@pytest.mark.torch
def test_check_blanks_a_decoded_url_password_quoted_elsewhere(tmp_path: pathlib.Path) -> None:
    output = check_output(
        tmp_path,
        redis_profile(
            "    url: redis+cluster://kv:p%40ss-w0rd@h1:7000\n    key_prefix: 'p@ss-w0rd{x}'\n"
        ),
    )

    assert "key_prefix" in output
    assert "p@ss-w0rd" not in output


def test_shown_blanks_a_value_given_under_a_secret_key() -> None:
    assert shown(SECRET, key="password") == "***"
