"""`kvwire run` with a medium that never connected: the run says so, and fails."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch


def released_port() -> int:
    """A loopback port bound then released: nothing listens there."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def run_unreachable_redis(
    tmp_path: pathlib.Path, *options: str
) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / "redis.yaml"
    profile.write_text(
        "model_config: {num_layers: 2, num_attention_heads: 4, num_kv_heads: 2, head_size: 16,\n"
        "               intermediate_size: 128, vocab_size: 512, max_model_len: 2048}\n"
        "cache_config: {block_size: 16, num_gpu_blocks: 128}\n"
        "kv_transfer_config:\n"
        "  kv_connector: RedisConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        f"    url: redis://127.0.0.1:{released_port()}/0\n"
        "    connect_timeout_s: 1\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "kvwire.run", str(profile), "--requests", "3", *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_a_run_whose_redis_is_unreachable_prints_nothing_connected_and_no_speed_up(
    tmp_path: pathlib.Path,
) -> None:
    result = run_unreachable_redis(tmp_path)

    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[-1].startswith(
        "FAILED: nothing connected: the connector stored and loaded nothing and reported "
    )
    assert "redis_saves_dropped" in lines[-1]
    speed_up = next(line for line in lines if line.startswith("speed-up (total)"))
    # No connector and local keep theirs; cold and warm show none.
    assert speed_up.split()[-4:] == ["1.00x", "-", "-", speed_up.split()[-1]]
    assert "warm / local TTFT p50: -" in lines


@pytest.mark.slow
def test_the_json_report_of_an_unreachable_redis_is_not_ok_and_names_the_failures(
    tmp_path: pathlib.Path,
) -> None:
    result = run_unreachable_redis(tmp_path, "--json")

    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert report["nothing_connected"]["redis_saves_dropped"] > 0
    assert report["nothing_connected"]["save_errors"] > 0
    for name in ("cold", "warm"):
        assert report["passes"][name]["speedup"] is None
        assert report["passes"][name]["ttft_p50_speedup"] is None
    assert report["warm_vs_local_ttft_p50"] is None
