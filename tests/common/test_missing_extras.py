"""A missing optional dependency says which extra of kvwire to install, in one line."""

from __future__ import annotations

import pathlib

import pytest

from kvwire.common.extras import EXTRA_OF_MODULE, missing_extra
from tests.support.blocked_imports import run_kvwire_without

CPU_OFFLOAD = """\
kv_transfer_config:
  kv_connector: CPUOffloadConnector
  kv_role: kv_both
"""

REDIS = """\
kv_transfer_config:
  kv_connector: RedisConnector
  kv_role: kv_both
  kv_connector_extra_config:
    url: redis://127.0.0.1:6379/0
"""

PEER = """\
kv_transfer_config:
  kv_connector: OffloadConnector
  kv_role: kv_both
  kv_connector_extra_config:
    medium: peer
    url: redis://127.0.0.1:6379/0
"""


def profile(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return str(path)


def test_kvwire_run_without_torch_names_the_torch_extra() -> None:
    result = run_kvwire_without(["torch"], ["run", "--requests", "1"])

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "kvwire run: error: kvwire run (its engine runs the model) needs torch, which is not "
        "installed: pip install 'kvwire[torch]'\n"
    )


def test_kvwire_check_without_torch_names_the_torch_extra(tmp_path: pathlib.Path) -> None:
    result = run_kvwire_without(["torch"], ["check", profile(tmp_path, CPU_OFFLOAD)])

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.endswith(
        "error: Connector 'CPUOffloadConnector' "
        "(kvwire.connectors.offload.presets:CPUOffloadConnector) needs torch, which is not "
        "installed: pip install 'kvwire[torch]'\n"
    )


def test_kvwire_replay_needs_no_extra(tmp_path: pathlib.Path) -> None:
    # An operator sizes a pool from a trace on any machine: no torch, no Redis client.
    extras = sorted(EXTRA_OF_MODULE)
    trace = str(tmp_path / "t.jsonl")
    generated = run_kvwire_without(extras, ["replay", "--generate", trace])
    assert generated.returncode == 0, generated.stderr

    replayed = run_kvwire_without(extras, ["replay", trace, "--blocks", "64"])

    assert (replayed.returncode, replayed.stderr) == (0, "")
    assert "kvfifo" in replayed.stdout


@pytest.mark.torch
def test_kvwire_check_without_redis_names_the_redis_extra(tmp_path: pathlib.Path) -> None:
    result = run_kvwire_without(["redis", "hiredis"], ["check", profile(tmp_path, REDIS)])

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.endswith(
        "error: kv_connector_extra_config.medium: medium 'redis (built in)' needs redis, which "
        "is not installed: pip install 'kvwire[redis]'\n"
    )


@pytest.mark.torch
def test_kvwire_check_of_the_peer_medium_without_nixl_names_the_peer_extra(
    tmp_path: pathlib.Path,
) -> None:
    result = run_kvwire_without(["nixl", "nixl_cu12"], ["check", profile(tmp_path, PEER)])

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.endswith(
        "error: the peer medium needs nixl_cu12, which is not installed: "
        "pip install 'kvwire[peer]'\n"
    )


@pytest.mark.torch
def test_kvwire_run_of_a_redis_profile_without_redis_names_the_redis_extra(
    tmp_path: pathlib.Path,
) -> None:
    path = profile(tmp_path, REDIS)
    result = run_kvwire_without(["redis"], ["run", path, "--requests", "1"])

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"kvwire run: {path}: error: kv_connector_extra_config.medium: medium 'redis (built in)' "
        "needs redis, which is not installed: pip install 'kvwire[redis]'\n"
    )


def test_a_missing_module_no_extra_provides_keeps_its_own_error() -> None:
    # A plug-in's own dependency, or a submodule missing from an installed package:
    # no extra of kvwire installs it, so none is named.
    assert missing_extra(ModuleNotFoundError("x", name="somebody_elses"), "it") is None
    assert missing_extra(ModuleNotFoundError("x", name="torch.distributed"), "it") is None
    assert missing_extra(ImportError("cannot import name 'x' from 'torch'"), "it") is None
