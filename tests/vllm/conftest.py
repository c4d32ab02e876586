"""A real vLLM engine on the CPU, with a tiny random-weight Llama built here, offline.

The environment is set before vLLM is imported: the engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the one test of the default
multi-process mode starts its own process), nothing is fetched from the hub,
the KV cache takes 1 GiB and vLLM's caches and kvwire's weight digests live
in temporary directories.
Collected only where vLLM is installed (tests/conftest.py): ``make test-vllm``
builds ``.venv-vllm`` and runs them there, or says why it cannot.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from pytest_redis import factories
from pytest_redis.executor import RedisExecutor

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="kvwire-vllm-cache-"))
# kvwire remembers weight digests under $XDG_CACHE_HOME: the tests' own, not the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="kvwire-vllm-xdg-cache-")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.vllm import (
    build_tiny_gemma3,
    build_tiny_llama,
    generate,
    running_llm,
    shared_prompts,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama with random weights and a word-level tokenizer, saved for vLLM."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer Gemma 3 with random weights: layers 0, 2 slide (window 64), 1, 3 are full."""
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tokens_without_connector(tiny_model: str) -> list[list[int]]:
    """What one vLLM engine without a connector generates for ``shared_prompts()``."""
    with running_llm(tiny_model) as llm:
        tokens, _ = generate(llm, shared_prompts())
    return tokens


# A real redis-server on a free loopback port, started by pytest-redis (``make
# redis-server`` installs one where none is found).
redis_server_process = factories.redis_proc(
    executable=shutil.which("redis-server") or shutil.which("valkey-server"), port=None
)


@pytest.fixture(scope="session")
def redis_url(redis_server_process: RedisExecutor) -> str:
    return f"redis://{redis_server_process.host}:{redis_server_process.port}/0"
