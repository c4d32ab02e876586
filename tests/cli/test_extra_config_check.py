"""``kvwire check`` validates each connector's kv_connector_extra_config without building it."""

from __future__ import annotations

import io
import pathlib
from typing import Any

import pytest
import yaml

from kvwire.cli import check_profile
from kvwire.config import KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError, int_key, read_extra_config
from kvwire.connectors.offload import CPUOffloadConnector
from kvwire.interface.base import ConnectorLookup, KVConnectorBase, validates_extra_config
from kvwire.registry import ConnectorRegistry
from tests.support.connectors import SAMPLES, RecordingConnector

# The built-in connectors it checks import torch.
pytestmark = pytest.mark.torch

REPO = pathlib.Path(__file__).resolve().parents[2]
SHIPPED_PROFILES = sorted((REPO / "src" / "kvwire" / "profiles").glob("*.yaml"))
UNSET_VARIABLE = "KVWIRE_TEST_UNSET_PASSWORD"
# Checks never create it: a constructor would, and would fail on this root.
STORE = "/nonexistent-kvwire-root/store"


class StrictConnector(RecordingConnector):
    """A third-party connector with the hook: ``colour`` is its only key."""

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, registry: ConnectorLookup
    ) -> None:
        for key in kv_transfer_config.kv_connector_extra_config:
            if key != "colour":
                raise ValueError(f"kv_connector_extra_config.{key}: not an option; only colour")


class CrashingConnector(RecordingConnector):
    """A third-party connector whose hook raises what no check expects, quoting a secret."""

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, registry: ConnectorLookup
    ) -> None:
        raise RuntimeError(f"cannot reach redis://u:{SECRET}@h " + "x" * 100_000)


SECRET = "hunter2-secret"


@pytest.fixture
def registry() -> ConnectorRegistry:
    """kvwire's connectors, plus a third-party one with the hook and one without."""
    registry = ConnectorRegistry(entry_point_group=None)
    registry.register_connector("RecordingConnector", SAMPLES, "RecordingConnector")
    registry.register_connector("StrictConnector", __name__, "StrictConnector")
    registry.register_connector("CrashingConnector", __name__, "CrashingConnector")
    return registry


def check(
    tmp_path: pathlib.Path, transfer: dict[str, Any], registry: ConnectorRegistry
) -> tuple[int, str, str]:
    """``kvwire check`` of a profile with ``transfer``: status, output, and the error text."""
    path = tmp_path / "profile.yaml"
    text = yaml.safe_dump(
        {"kv_transfer_config": {"kv_role": "kv_both", **transfer}}, sort_keys=False
    )
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    status = check_profile(str(path), registry=registry, out=out, err=err)
    prefix = f"kvwire check: {path}: error: "
    assert not err.getvalue() or err.getvalue().startswith(prefix)
    return status, out.getvalue(), err.getvalue().removeprefix(prefix).removesuffix("\n")


@pytest.mark.parametrize("profile", SHIPPED_PROFILES, ids=lambda path: path.name)
def test_every_shipped_profile_passes_with_its_extra_config_checked(
    profile: pathlib.Path, registry: ConnectorRegistry
) -> None:
    out, err = io.StringIO(), io.StringIO()

    status = check_profile(str(profile), registry=registry, out=out, err=err)

    assert status == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    [extra_config] = [line for line in lines if line.startswith("extra config: ")]
    assert " valid (" in extra_config
    children = [line for line in lines if line.startswith("  child ")]
    assert all("; extra config: " in line and " valid (" in line for line in children)


def test_check_says_which_keys_it_checked(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, out, _ = check(
        tmp_path,
        {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_extra_config": {"cpu_pool_bytes": "1GiB", "io_threads": 2},
        },
        registry,
    )

    assert status == 0
    assert out.splitlines()[3] == "extra config: 2 keys valid (cpu_pool_bytes, io_threads)"


def test_check_says_when_the_defaults_apply(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, out, _ = check(tmp_path, {"kv_connector": "CPUOffloadConnector"}, registry)

    assert status == 0
    assert out.splitlines()[3] == (
        "extra config: valid (no keys given; CPUOffloadConnector's defaults apply)"
    )


def test_check_of_a_composite_says_it_for_each_child(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    children = [
        {"kv_connector": "CPUOffloadConnector"},
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": STORE, "fsync": True},
        },
        {"kv_connector": "RecordingConnector", "kv_connector_extra_config": {"anything": 1}},
    ]
    status, out, _ = check(
        tmp_path,
        {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": children}},
        registry,
    )

    assert status == 0
    lines = out.splitlines()
    assert lines[3].endswith(
        "; extra config: valid (no keys given; CPUOffloadConnector's defaults apply)"
    )
    assert lines[4].endswith("; extra config: 2 keys valid (shared_storage_path, fsync)")
    assert lines[5].endswith(
        "; extra config: not checked (RecordingConnector has no validate_extra_config)"
    )
    assert lines[6] == (
        "extra config: 1 key valid (connectors); each child's by its own class (child lines above)"
    )
    assert not pathlib.Path(STORE).parent.exists()


BAD_EXTRA_CONFIGS = [
    pytest.param(
        "CPUOffloadConnector",
        {"cpu_pool_byte": "1GiB"},
        "kv_connector_extra_config.cpu_pool_byte is not an option of CPUOffloadConnector "
        "(did you mean 'cpu_pool_bytes'?); accepted keys are: async_load, async_lookup, "
        "cpu_pool_bytes, eviction, io_threads, load_failures_to_pause, load_pause_s, "
        "lookup_deadline_s, medium, save_threshold, transfer_timeout_s",
        id="cpu-offload-typo",
    ),
    pytest.param(
        "CPUOffloadConnector",
        {"eviction": "S3FIFO"},
        "kv_connector_extra_config.eviction: unknown eviction policy 'S3FIFO'; expected one of "
        "lru, s3fifo, arc, kvfifo, or a class as 'package.module:Class'; did you mean 's3fifo'?",
        id="cpu-offload-eviction-name",
    ),
    pytest.param(
        "CPUOffloadConnector",
        {"eviction": "collections:OrderedDict"},
        "kv_connector_extra_config.eviction: eviction policy 'collections:OrderedDict' is "
        "<class 'collections.OrderedDict'>, not a class deriving from "
        "kvwire.media.eviction.EvictionPolicy",
        id="cpu-offload-eviction-class",
    ),
    pytest.param(
        "CPUOffloadConnector",
        {"save_threshold": 0},
        "kv_connector_extra_config.save_threshold: 0 is not accepted by CPUOffloadConnector; "
        "expected an integer between 1 and 64",
        id="cpu-offload-save-threshold",
    ),
    pytest.param(
        "CPUOffloadConnector",
        {"io_threads": "two"},
        "kv_connector_extra_config.io_threads: 'two' is not accepted by CPUOffloadConnector; "
        "expected an integer between 1 and 64",
        id="cpu-offload-type",
    ),
    pytest.param(
        "CPUOffloadConnector",
        {"cpu_pool_bytes": "1 parsec"},
        "kv_connector_extra_config.cpu_pool_bytes: '1 parsec' is not accepted by "
        'CPUOffloadConnector; expected a byte count >= 1, as an int or a string such as "512MiB"',
        id="cpu-offload-size",
    ),
    pytest.param(
        "SharedStorageConnector",
        {"shared_storage_path": STORE, "fsynch": True},
        "kv_connector_extra_config.fsynch is not an option of SharedStorageConnector "
        "(did you mean 'fsync'?); accepted "
        "keys are: allow_other_owner, async_load, async_lookup, batch_blocks, entry_kv_heads, "
        "entry_layers, file_mode, fsync, io_threads, load_failures_to_pause, load_pause_s, "
        "lookup_deadline_s, mac_key_env, "
        "max_bytes, max_save_bytes_in_flight, medium, page_cache, shared_storage_path, "
        "transfer_timeout_s",
        id="shared-storage-typo",
    ),
    pytest.param(
        "SharedStorageConnector",
        {"shared_storage_path": STORE, "fsync": "yes"},
        "kv_connector_extra_config.fsync: 'yes' is not accepted by SharedStorageConnector; "
        "expected true or false",
        id="shared-storage-type",
    ),
    pytest.param(
        "SharedStorageConnector",
        {"shared_storage_path": STORE, "max_bytes": "lots"},
        "kv_connector_extra_config.max_bytes: 'lots' is not accepted by SharedStorageConnector; "
        'expected a byte count >= 0, as an int or a string such as "512MiB"',
        id="shared-storage-size",
    ),
    pytest.param(
        "SharedStorageConnector",
        {"fsync": True},
        "kv_connector_extra_config.shared_storage_path is required by SharedStorageConnector: "
        "a non-empty directory path without NUL bytes (required)",
        id="shared-storage-missing",
    ),
    pytest.param(
        "RedisConnector",
        {"ttl": 60},
        "kv_connector_extra_config.ttl is not an option of RedisConnector; accepted keys are: "
        "async_load, async_lookup, batch_blocks, connect_timeout_s, db, entry_kv_heads, "
        "entry_layers, io_threads, key_prefix, load_failures_to_pause, load_pause_s, "
        "load_timeout_s, lookup_batch_size, lookup_deadline_s, lookup_timeout_s, mac_key_env, "
        "max_save_bytes_in_flight, medium, password, "
        "password_env, pipeline_bytes, pool_size, retry_interval_s, save_timeout_s, "
        "socket_timeout_s, tls_ca_certs, tls_certfile, tls_keyfile, "
        "tls_verify, transfer_timeout_s, ttl_seconds, url, username, warning_interval_s",
        id="redis-typo",
    ),
    pytest.param(
        "RedisConnector",
        {"ttl_seconds": "1h"},
        "RedisConnector: invalid Redis settings:\n"
        "  kv_connector_extra_config.ttl_seconds: expected a whole number of seconds > 0 and "
        "<= 315360000 (3650 days), restarted by every load, or null for no expiry, got '1h'",
        id="redis-type",
    ),
    pytest.param(
        "RedisConnector",
        {"max_save_bytes_in_flight": "big"},
        "kv_connector_extra_config.max_save_bytes_in_flight: 'big' is not accepted by "
        'RedisConnector; expected a byte count >= 1, as an int or a string such as "512MiB"',
        id="redis-size",
    ),
    pytest.param(
        "RedisConnector",
        {"url": "http://cache.internal:6379/0"},
        "RedisConnector: invalid Redis settings:\n"
        "  kv_connector_extra_config.url: scheme must be one of redis://, rediss://, unix://, "
        "redis+cluster://, rediss+cluster://, got 'http'",
        id="redis-url",
    ),
    pytest.param(
        "RedisConnector",
        {"password_env": UNSET_VARIABLE},
        "RedisConnector: invalid Redis settings:\n"
        f"  kv_connector_extra_config.password_env: environment variable {UNSET_VARIABLE!r} "
        "is not set",
        id="redis-password-env-unset",
    ),
    pytest.param(
        "MultiConnector",
        {"connectors": [{"kv_connector": "CPUOffloadConnector"}], "mode": "all"},
        "kv_connector_extra_config.mode is not an option of MultiConnector; accepted keys are: "
        "connectors",
        id="multi-typo",
    ),
    pytest.param(
        "MultiConnector",
        {},
        "kv_connector_extra_config.connectors: None is not accepted by MultiConnector; expected "
        "a non-empty list of kv_transfer_config mappings",
        id="multi-missing",
    ),
    # A misplaced value is named by its type: it may be a secret (this URL's password).
    pytest.param(
        "MultiConnector",
        {"connectors": "redis://:hunter2@cache.internal:6379/0"},
        "kv_connector_extra_config.connectors: a str is not accepted by MultiConnector; expected "
        "a non-empty list of kv_transfer_config mappings",
        id="multi-connectors-not-a-list",
    ),
    pytest.param(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "CPUOffloadConnector"},
                "redis://:hunter2@cache.internal:6379/0",
            ]
        },
        "kv_transfer_config.kv_connector_extra_config.connectors[1]: expected a mapping of "
        "KVTransferConfig fields, got a str",
        id="multi-child-not-a-mapping",
    ),
    pytest.param(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "CPUOffloadConnector"},
                {
                    "kv_connector": "CPUOffloadConnector",
                    "kv_connector_extra_config": {"cpu_pool_byte": "1GiB"},
                },
            ]
        },
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config.cpu_pool_byte is not "
        "an option of CPUOffloadConnector (did you mean 'cpu_pool_bytes'?); accepted keys are: "
        "async_load, async_lookup, cpu_pool_bytes, eviction, io_threads, load_failures_to_pause, "
        "load_pause_s, lookup_deadline_s, medium, save_threshold, transfer_timeout_s",
        id="multi-child-typo",
    ),
    pytest.param(
        "MultiConnector",
        {
            "connectors": [
                {
                    "kv_connector": "CPUOffloadConnector",
                    "kv_connector_extra_config": {"io_threads": 2.5},
                },
                {"kv_connector": "CPUOffloadConnector"},
            ]
        },
        "kv_connector_extra_config.connectors[0].kv_connector_extra_config.io_threads: 2.5 is "
        "not accepted by CPUOffloadConnector; expected an integer between 1 and 64",
        id="multi-child-type",
    ),
    pytest.param(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "CPUOffloadConnector"},
                {
                    "kv_connector": "RedisConnector",
                    "kv_connector_extra_config": {"max_save_bytes_in_flight": "-1MiB"},
                },
            ]
        },
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config."
        "max_save_bytes_in_flight: '-1MiB' is not accepted by RedisConnector; expected a byte "
        'count >= 1, as an int or a string such as "512MiB"',
        id="multi-child-size",
    ),
    pytest.param(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "CPUOffloadConnector"},
                {"kv_connector": "SharedStorageConnector"},
            ]
        },
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config.shared_storage_path "
        "is required by SharedStorageConnector: a non-empty directory path without NUL bytes "
        "(required)",
        id="multi-child-missing",
    ),
    pytest.param(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "RedisConnector", "kv_connector_extra_config": {"db": -1}},
            ]
        },
        "kv_connector_extra_config.connectors[0]: RedisConnector: invalid Redis settings:\n"
        "  kv_connector_extra_config.connectors[0].kv_connector_extra_config.db: expected a "
        "database number >= 0 or null, got -1",
        id="multi-redis-child",
    ),
]


@pytest.mark.parametrize(("connector", "extra", "message"), BAD_EXTRA_CONFIGS)
def test_check_fails_naming_the_key_and_what_is_accepted(
    connector: str,
    extra: dict[str, Any],
    message: str,
    tmp_path: pathlib.Path,
    registry: ConnectorRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNSET_VARIABLE, raising=False)

    status, out, error = check(
        tmp_path, {"kv_connector": connector, "kv_connector_extra_config": extra}, registry
    )

    assert (status, out) == (1, "")
    assert error == message


def test_check_builds_nothing(
    tmp_path: pathlib.Path, registry: ConnectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: KVConnectorBase, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"kvwire check built a {type(self).__name__}")

    monkeypatch.setattr(KVConnectorBase, "__init__", refuse)
    children = [
        {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_extra_config": {"cpu_pool_bytes": "1GiB"},
        },
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": STORE},
        },
        {
            "kv_connector": "RedisConnector",
            "kv_connector_extra_config": {"url": "redis://127.0.0.1:1/0"},
        },
    ]

    status, _, error = check(
        tmp_path,
        {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": children}},
        registry,
    )

    assert (status, error) == (0, "")
    assert not pathlib.Path(STORE).parent.exists()


def test_a_set_password_env_passes_and_its_value_is_not_shown(
    tmp_path: pathlib.Path, registry: ConnectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(UNSET_VARIABLE, "env-secret-3")

    status, out, error = check(
        tmp_path,
        {
            "kv_connector": "RedisConnector",
            "kv_connector_extra_config": {"password_env": UNSET_VARIABLE},
        },
        registry,
    )

    assert (status, error) == (0, "")
    assert "extra config: 1 key valid (password_env)" in out.splitlines()
    assert "env-secret-3" not in out


def test_a_connector_without_the_hook_passes_as_not_checked(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, out, _ = check(
        tmp_path,
        {"kv_connector": "RecordingConnector", "kv_connector_extra_config": {"anything": 1}},
        registry,
    )

    assert status == 0
    assert out.splitlines()[3] == (
        "extra config: not checked (RecordingConnector has no validate_extra_config)"
    )


def test_a_third_party_hook_is_called_for_the_connector_and_as_a_child(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    strict = {"kv_connector": "StrictConnector", "kv_connector_extra_config": {"size": 2}}
    composite = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "RecordingConnector"}, strict]
        },
    }

    assert check(tmp_path, strict, registry)[2] == (
        "kv_connector_extra_config.size: not an option; only colour"
    )
    assert check(tmp_path, composite, registry)[2] == (
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config.size: not an option; "
        "only colour"
    )
    status, out, _ = check(
        tmp_path,
        {"kv_connector": "StrictConnector", "kv_connector_extra_config": {"colour": "red"}},
        registry,
    )
    assert status == 0
    assert out.splitlines()[3] == "extra config: 1 key valid (colour)"


def test_a_child_error_that_names_no_key_is_prefixed_with_the_child(
    tmp_path: pathlib.Path, registry: ConnectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    def vague(
        cls: type[KVConnectorBase], kv_transfer_config: KVTransferConfig, resolve: Any
    ) -> None:
        raise ValueError("something is off")

    monkeypatch.setattr(StrictConnector, "validate_extra_config", classmethod(vague))
    composite = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [{"kv_connector": "StrictConnector"}]},
    }

    assert check(tmp_path, composite, registry)[2] == (
        "kv_connector_extra_config.connectors[0]: something is off"
    )


def test_which_classes_validate_their_extra_config() -> None:
    assert not validates_extra_config(RecordingConnector)
    assert validates_extra_config(StrictConnector)
    assert validates_extra_config(type("Sub", (StrictConnector,), {}))
    assert validates_extra_config(CPUOffloadConnector)


def test_unknown_keys_of_mixed_types_are_all_reported() -> None:
    with pytest.raises(ExtraConfigError) as caught:
        read_extra_config("Some", {1: "x", "zz": 2}, [int_key("n", 1, minimum=0)])

    assert str(caught.value) == (
        "kv_connector_extra_config.1 is not an option of Some; accepted keys are: n\n"
        "kv_connector_extra_config.zz is not an option of Some; accepted keys are: n"
    )


def test_a_huge_bad_value_is_shown_cut_with_its_size() -> None:
    with pytest.raises(ExtraConfigError) as caught:
        read_extra_config("Some", {"n": "9" * 1_000_000}, [int_key("n", 1, minimum=0)])

    assert str(caught.value) == (
        f"kv_connector_extra_config.n: '{'9' * 79}... (a str of 1000000 characters) is not "
        "accepted by Some; expected an integer >= 0"
    )


def test_a_plugin_hook_that_raises_is_an_error_naming_it_bounded_and_redacted(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, out, error = check(tmp_path, {"kv_connector": "CrashingConnector"}, registry)

    assert (status, out) == (1, "")
    assert error.startswith(
        "kv_connector_extra_config: CrashingConnector.validate_extra_config raised "
        "RuntimeError: cannot reach redis://u:***@h"
    ), error
    assert SECRET not in error
    assert len(error) < 600
