"""Validation of kv_connector_extra_config: every problem named, all at once."""

from __future__ import annotations

import re

import pytest

from kvwire.connectors.extra_config import (
    ExtraConfigError,
    bool_key,
    int_key,
    parse_size,
    read_extra_config,
    size_key,
    str_key,
)

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
