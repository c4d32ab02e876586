"""Disaggregated prefill end to end: two engine processes and one Redis server.

The prefill engine (``kv_producer``) computes the prompts and saves their KV
blocks; the decode engine (``kv_consumer``, another process) loads them and
continues. Its tokens must be those of one engine doing both.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
from typing import Any

import pytest

from tests.support.redis import RedisServer

# Each test runs two engines, each in a Python of its own.
pytestmark = pytest.mark.slow

EXAMPLE = pathlib.Path(__file__).resolve().parents[4] / "examples/disaggregated_prefill/disagg.py"
PROMPT_LEN = 100  # 6 full blocks of 16 tokens, then 4 more
BLOCK_SIZE = 16


def run_engine(role: str, tmp_path: pathlib.Path, *options: str) -> dict[str, Any]:
    output = tmp_path / f"{role}.json"
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            role,
            "--prompt-len",
            str(PROMPT_LEN),
            "--num-requests",
            "3",
            "--max-tokens",
            "6",
            "--output",
            str(output),
            *options,
        ],
        check=True,
        timeout=240,
        capture_output=True,
        text=True,
    )
    report: dict[str, Any] = json.loads(output.read_text())
    # What the role did, said on stderr.
    assert f"disagg.py {role}: 3 of 3 requests finished" in result.stderr
    return report


def assert_decode_continues_from_prefill(
    tmp_path: pathlib.Path, *store_options: str
) -> dict[str, Any]:
    """Runs the prefill engine, then the decode engine, on the store ``store_options`` name,
    and one engine doing both; checks that the decode engine's tokens are the single
    engine's and that every full prompt block came from the prefill engine. Returns the
    decode engine's report."""
    prefill = run_engine("prefill", tmp_path, *store_options)
    decode = run_engine("decode", tmp_path, *store_options)
    single = run_engine("single", tmp_path)

    assert [r["output_token_ids"] for r in decode["requests"]] == [
        r["output_token_ids"] for r in single["requests"]
    ]
    assert all(len(r["output_token_ids"]) == 1 for r in prefill["requests"])
    full_blocks = (PROMPT_LEN - 1) // BLOCK_SIZE
    assert [r["external_tokens"] for r in decode["requests"]] == [full_blocks * BLOCK_SIZE] * 3
    assert decode["connector_stats"]["blocks_loaded"] == 3 * full_blocks
    return decode


def test_the_decode_engine_continues_from_the_prefill_engines_blocks(
    redis_server: RedisServer, key_prefix: str, tmp_path: pathlib.Path
) -> None:
    server = ["--redis-url", redis_server.url, "--key-prefix", key_prefix]

    decode = assert_decode_continues_from_prefill(tmp_path, *server)

    assert all(r["error"] is None for r in decode["requests"])


def test_a_decode_engine_without_the_prefill_computes_everything_itself(
    redis_server: RedisServer, key_prefix: str, tmp_path: pathlib.Path
) -> None:
    server = ["--redis-url", redis_server.url, "--key-prefix", key_prefix]

    decode = run_engine("decode", tmp_path, *server)
    single = run_engine("single", tmp_path)

    assert [r["output_token_ids"] for r in decode["requests"]] == [
        r["output_token_ids"] for r in single["requests"]
    ]
    assert [r["external_tokens"] for r in decode["requests"]] == [0, 0, 0]


def test_a_role_whose_redis_cannot_be_reached_fails_and_says_how_to_start_one(
    tmp_path: pathlib.Path,
) -> None:
    # A port nothing listens on: bound, then released.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"redis://:hunter2@127.0.0.1:{port}/0"

    for role in ("prefill", "decode"):
        result = subprocess.run(
            [sys.executable, str(EXAMPLE), role, "--redis-url", url, "--output", "x.json"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

        assert result.returncode == 1, result.stderr
        assert f"disagg.py {role}: cannot reach Redis at redis://" in result.stderr
        assert f"127.0.0.1:{port}/0" in result.stderr and "--redis-url" in result.stderr
        assert "hunter2" not in result.stderr
        assert not (tmp_path / "x.json").exists()
