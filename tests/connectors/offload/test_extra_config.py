"""kv_connector_extra_config: every problem named at once, alike by constructor and check."""

from __future__ import annotations

import io
import re

import pytest
import yaml

from kvwire.cli import check_profile
from kvwire.config.extra_config import (
    ExtraConfigError,
    bool_key,
    int_key,
    parse_size,
    read_extra_config,
    size_key,
    str_key,
)
from kvwire.container import container_for_profile
from kvwire.registry import default_registry
from tests.support.pairs import cache_config_for, engine_config

KEYS = (size_key("pool", 100), int_key("threads", 2, 1, 8), bool_key("fast", False))


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 * 1024**2), ("2GB", 2 * 10**9), ("1.5KiB", 1536), ("64", 64), (4096, 4096)],
)
def test_sizes_read_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "5 parsecs", True, None, -1.5])
def test_unreadable_sizes_are_none(text):
    assert parse_size(text) is None


@pytest.mark.parametrize("text", ["1.3", "0.5B", "1.0001KiB"])
def test_a_size_that_is_no_whole_number_of_bytes_is_unreadable_not_rounded(text):
    assert parse_size(text) is None


@pytest.mark.parametrize("text", ["\uff11\uff12", "\u0663\u0660MiB"])
def test_a_size_written_in_other_than_ascii_digits_is_unreadable(text):
    assert parse_size(text) is None


def test_defaults_fill_missing_keys():
    assert read_extra_config("X", {}, KEYS) == {"pool": 100, "threads": 2, "fast": False}


def test_every_problem_is_reported_together():
    with pytest.raises(ExtraConfigError) as raised:
        read_extra_config("X", {"threads": 9, "fast": "yes", "colour": "red"}, KEYS)
    lines = str(raised.value).splitlines()
    assert lines == [
        "kv_connector_extra_config.colour is not an option of X; accepted keys are: fast, pool, "
        "threads",
        "kv_connector_extra_config.threads: 9 is not accepted by X; expected an integer between "
        "1 and 8",
        "kv_connector_extra_config.fast: 'yes' is not accepted by X; expected true or false",
    ]


def test_a_boolean_is_not_an_integer():
    with pytest.raises(ExtraConfigError, match="threads: True is not accepted"):
        read_extra_config("X", {"threads": True}, KEYS)


def test_a_required_key_must_be_given():
    with pytest.raises(
        ExtraConfigError, match=re.escape("kv_connector_extra_config.path is required by X")
    ):
        read_extra_config("X", {}, (str_key("path", None, required=True),))


UNSET_VARIABLE = "KVWIRE_TEST_UNSET_PASSWORD"
BAD_CONFIGS = [
    pytest.param("CPUOffloadConnector", {"cpu_pool_byte": "1GiB", "io_threads": 0}, id="cpu"),
    pytest.param("SharedStorageConnector", {"max_bytes": "lots"}, id="shared-storage"),
    pytest.param(
        "RedisConnector",
        {"url": "unix://", "pool_size": 0, "password_env": UNSET_VARIABLE},
        id="redis",
    ),
    pytest.param("RedisConnector", {"password": "pw", "password_env": "PW"}, id="redis-both"),
    pytest.param(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "CPUOffloadConnector"},
                {
                    "kv_connector": "SharedStorageConnector",
                    "kv_connector_extra_config": {"fsync": "yes"},
                },
            ]
        },
        id="multi-child",
    ),
    pytest.param(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "RedisConnector", "kv_connector_extra_config": {"ttl_seconds": 0}}
            ]
        },
        id="multi-redis-child",
    ),
    pytest.param("MultiConnector", {"connectors": [], "mode": "all"}, id="multi"),
]


@pytest.mark.parametrize(("connector", "extra"), BAD_CONFIGS)
def test_the_constructor_and_check_reject_the_same_config_in_the_same_words(
    connector, extra, tmp_path, monkeypatch
):
    monkeypatch.delenv(UNSET_VARIABLE, raising=False)
    registry = default_registry()
    config = engine_config(connector, extra)
    transfer = config.kv_transfer_config
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "kv_transfer_config": {
                    "kv_connector": connector,
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                }
            }
        )
    )

    container = container_for_profile(config, kv_cache_config=cache_config_for(config))
    with pytest.raises(ExtraConfigError) as built:
        container.worker_connector()
    with pytest.raises(ExtraConfigError) as validated:
        registry.resolve(transfer).validate_extra_config(transfer, registry)
    err = io.StringIO()
    status = check_profile(str(profile), out=io.StringIO(), err=err)

    assert str(validated.value) == str(built.value)
    assert (status, err.getvalue()) == (1, f"kvwire check: {profile}: error: {built.value}\n")
