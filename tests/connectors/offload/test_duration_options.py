"""Every duration option has a finite bound: `kvwire check`, `kvwire run` refuse one past it.

An infinite, huge or NaN duration overflows what waits on it (a socket
timeout, a deadline, Redis's expiry), so every store and load would fail. The
durations are found the way a user finds them, in the keys the offload
connector accepts over each medium (an unknown key's error lists them), by
their names: `*_s` and `*_seconds`. `BOUNDS` is the bound of each, as
docs/profiles.md documents them: a new duration key fails these tests until
it has a bound here and in its declaration. (vLLM's start refuses them too:
tests/vllm/test_duration_options.py.)
"""

from __future__ import annotations

import io
import math
import pathlib
import re
from typing import Any

import pytest
import yaml

from kvwire import cli
from kvwire.cli import check_profile
from kvwire.config import KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError, seconds_accepted
from kvwire.connectors.offload import OffloadConnector
from kvwire.registry import default_registry

# Checks never create it: a constructor would, and would fail on this root.
STORE = "/nonexistent-kvwire-root/store"
HOUR, DAY = 3600, 24 * 3600

# Each duration key and its bound, in seconds; ttl_seconds is whole seconds,
# warning_interval_s may be 0.
BOUNDS: dict[str, int] = {
    "lookup_deadline_s": HOUR,
    "load_pause_s": DAY,
    "transfer_timeout_s": DAY,
    "directory_ttl_s": 30 * DAY,
    "peer_heartbeat_s": HOUR,
    "ttl_seconds": 3650 * DAY,
    "socket_timeout_s": HOUR,
    "connect_timeout_s": HOUR,
    "load_timeout_s": HOUR,
    "save_timeout_s": HOUR,
    "lookup_timeout_s": HOUR,
    "retry_interval_s": HOUR,
    "warning_interval_s": DAY,
}

# What each medium needs besides the key under test.
REQUIRED: dict[str, dict[str, Any]] = {
    "directory": {"shared_storage_path": STORE},
    "tiered": {"tiers": [{"medium": "directory", "shared_storage_path": STORE}]},
}


def _transfer(medium: str, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="OffloadConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"medium": medium, **REQUIRED.get(medium, {}), **extra},
    )


def accepted_keys(medium: str) -> list[str]:
    """The keys the offload connector accepts over `medium`, as its unknown-key error lists them."""
    medium_class = default_registry().media.get_class(medium)
    try:
        OffloadConnector.read_options(_transfer(medium, no_such_key=1), medium_class)
    except ExtraConfigError as error:
        listed = re.search(r"accepted keys are: (.*)$", str(error), re.MULTILINE)
        assert listed is not None, str(error)
        return listed.group(1).split(", ")
    raise AssertionError(f"an unknown key was accepted over {medium}")


def _is_duration(key: str) -> bool:
    return key.endswith(("_s", "_seconds"))


MEDIA = default_registry().media.names()
DURATIONS = [
    pytest.param(medium, key, id=f"{medium}-{key}")
    for medium in MEDIA
    for key in accepted_keys(medium)
    if _is_duration(key)
]


def accepted(key: str) -> str:
    return seconds_accepted(
        BOUNDS[key], zero=key == "warning_interval_s", whole=key == "ttl_seconds"
    )


def check(tmp_path: pathlib.Path, medium: str, key: str, value: object) -> tuple[int, str]:
    """`kvwire check` of a profile setting `key` to `value` over `medium`: status, error text."""
    transfer = _transfer(medium, **{key: value})
    path = tmp_path / "profile.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "kv_transfer_config": {
                    "kv_connector": transfer.kv_connector,
                    "kv_role": transfer.kv_role,
                    "kv_connector_extra_config": transfer.kv_connector_extra_config,
                }
            }
        )
    )
    out, err = io.StringIO(), io.StringIO()
    status = check_profile(str(path), out=out, err=err)
    return status, err.getvalue()


def test_every_duration_key_a_medium_accepts_has_a_bound_here() -> None:
    found = {key for medium in MEDIA for key in accepted_keys(medium) if _is_duration(key)}

    assert found == set(BOUNDS)


@pytest.mark.parametrize(
    "value", [math.inf, 1e10, math.nan], ids=["infinite", "ten-billion", "nan"]
)
@pytest.mark.parametrize(("medium", "key"), DURATIONS)
def test_check_refuses_a_duration_that_is_not_finite_and_bounded(
    medium: str, key: str, value: float, tmp_path: pathlib.Path
) -> None:
    status, error = check(tmp_path, medium, key, value)

    assert status == 1
    assert f"kv_connector_extra_config.{key}: " in error
    assert accepted(key) in error


@pytest.mark.parametrize(("medium", "key"), DURATIONS)
def test_check_refuses_a_duration_just_over_its_bound(
    medium: str, key: str, tmp_path: pathlib.Path
) -> None:
    status, error = check(tmp_path, medium, key, BOUNDS[key] + 1)

    assert status == 1
    assert f"kv_connector_extra_config.{key}: " in error
    assert accepted(key) in error


@pytest.mark.parametrize(("medium", "key"), DURATIONS)
def test_check_accepts_a_duration_at_its_bound(
    medium: str, key: str, tmp_path: pathlib.Path
) -> None:
    status, error = check(tmp_path, medium, key, BOUNDS[key])

    assert (status, error) == (0, "")


def test_the_error_names_the_key_and_the_finite_range_accepted(tmp_path: pathlib.Path) -> None:
    status, error = check(tmp_path, "redis", "socket_timeout_s", math.inf)

    assert status == 1
    assert error.splitlines()[1:] == [
        "  kv_connector_extra_config.socket_timeout_s: expected a finite number of seconds > 0 "
        "and <= 3600 (1 hour), got inf"
    ]


def test_a_tier_s_duration_is_refused_by_its_place_in_the_tiers(tmp_path: pathlib.Path) -> None:
    tier = {"medium": "redis", "socket_timeout_s": math.inf}

    status, error = check(tmp_path, "tiered", "tiers", [tier])

    assert status == 1
    assert "kv_connector_extra_config.tiers[0].socket_timeout_s: expected a finite number" in error


def test_kvwire_run_refuses_an_infinite_redis_timeout_before_any_pass(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "redis.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "kv_transfer_config": {
                    "kv_connector": "RedisConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"socket_timeout_s": math.inf},
                }
            }
        )
    )

    assert cli.main(["run", str(profile), "--no-progress"]) == 2
    assert "kv_connector_extra_config.socket_timeout_s: expected a finite number" in (
        capsys.readouterr().err
    )
