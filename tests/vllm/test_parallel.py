"""KVWireConnector in tensor- and pipeline-parallel vLLM engines, and entries shared across sizes.

A TP=2 engine runs in a process of its own (vLLM's multiprocessing executor,
each rank bound to its own core by ``VLLM_CPU_OMP_THREADS_BIND``); the TP=1
engines run in this process. Every store sets ``entry_kv_heads: 1``: an
entry holds one KV head of a block, so what a TP=2 engine stores (each rank
its head) a TP=1 engine loads, and the reverse; a PP=2 engine's store sets
``entry_layers: 1`` as well (each stage stores its layer). One TP=2 engine
serves the TP tests and one PP=2 engine the PP test (each costs a minute or
more on two cores).
"""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

import attrs
import pytest

import kvwire.vllm
from kvwire.blocks.format import HEADER_SIZE, BlockLayout, HeadShard
from kvwire.blocks.shards import entry_layout
from tests.support.vllm import (
    BLOCK_SIZE,
    MAX_TOKENS,
    generate,
    kvwire_transfer_config,
    run_engine_process,
    running_llm,
    shared_prompts,
)

PROMPTS = shared_prompts()
# Prompts of their own (another offset), for the TP=1 -> TP=2 direction.
OTHER_PROMPTS = [
    {"prompt_token_ids": [(index * 11 + position) % 1000 + 5 for position in range(300)]}
    for index in range(3)
]
# A prompt a TP=1 engine stores in Redis alone, for the TP=1 -> TP=2 direction there.
REDIS_PROMPTS = [{"prompt_token_ids": [(position * 13) % 1000 + 7 for position in range(300)]}]
LOADABLE_TOKENS = (300 - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt token is always computed
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
# Each of the two ranks on a core of its own: vLLM refuses TP=2 on a CPU otherwise.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# A TP=2 engine takes one to four minutes to start and run on two busy cores.
TP2_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(900)


def shared_storage(path: pathlib.Path) -> dict[str, Any]:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {
            "shared_storage_path": str(path),
            "fsync": False,
            "entry_kv_heads": 1,
        },
    }


def redis(url: str, key_prefix: str) -> dict[str, Any]:
    return {
        "kv_connector": "RedisConnector",
        "kv_connector_extra_config": {"url": url, "key_prefix": key_prefix, "entry_kv_heads": 1},
    }


def profile(*connectors: dict[str, Any]) -> dict[str, Any]:
    """A kvwire profile of one connector, or a MultiConnector of several (saves go to all)."""
    if len(connectors) == 1:
        transfer = dict(connectors[0])
    else:
        transfer = {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": list(connectors)},
        }
    return {"kv_transfer_config": {**transfer, "kv_role": "kv_both"}}


@attrs.frozen
class Stores:
    directory: pathlib.Path
    redis_url: str
    key_prefix: str


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Stores:
    return Stores(
        tmp_path_factory.mktemp("parallel-store"), redis_url, f"kvwire:tp-{uuid.uuid4().hex[:8]}:"
    )


def one_head_folders(llm: Any, root: pathlib.Path) -> list[pathlib.Path]:
    """The folders of the entries of KV head 0 and of head 1, in this engine's layout."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    container = get_kv_transfer_group().container
    engine = BlockLayout.from_engine_config(container.engine_config())
    return [
        root / entry_layout(engine, HeadShard(head, head + 1, 2)).fingerprint_hex for head in (0, 1)
    ]


def entries(folder: pathlib.Path) -> set[pathlib.Path]:
    return {path for path in folder.rglob("*") if path.is_file() and len(path.name) == 64}


@pytest.fixture(scope="module")
def tp1_tokens_of_other_prompts(tiny_model: str, stores: Stores) -> list[list[int]]:
    """A TP=1 engine stores OTHER_PROMPTS; then one rank's shard of the first prompt's blocks
    is damaged (head 1's: rank 1 of a TP=2 reader loads it) and the other's of the second
    deleted (head 0's: only rank 0's entries of those blocks are missing)."""
    connector = shared_storage(stores.directory)
    with running_llm(tiny_model, kvwire_transfer_config(profile(connector))) as llm:
        written: list[set[pathlib.Path]] = []
        tokens: list[list[int]] = []
        for prompt in OTHER_PROMPTS:
            tokens += generate(llm, [prompt])[0]
            kvwire.vllm.wait_for_saves(llm)
            written.append(set().union(*map(entries, one_head_folders(llm, stores.directory))))
        head_zero, head_one = one_head_folders(llm, stores.directory)
    damaged = written[0] & entries(head_one)
    assert damaged
    for path in damaged:
        entry = bytearray(path.read_bytes())
        entry[HEADER_SIZE + 1] ^= 0xFF
        path.write_bytes(bytes(entry))
    missing = (written[1] - written[0]) & entries(head_zero)
    assert missing
    for path in missing:
        path.unlink()
    return tokens


@pytest.fixture(scope="module")
def tp1_tokens_in_redis(tiny_model: str, stores: Stores) -> list[list[int]]:
    """A TP=1 engine stores REDIS_PROMPTS in Redis (one entry per KV head)."""
    connector = redis(stores.redis_url, stores.key_prefix)
    with running_llm(tiny_model, kvwire_transfer_config(profile(connector))) as llm:
        tokens, _cached = generate(llm, REDIS_PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
    return tokens


@pytest.fixture(scope="module")
def tp2_run(
    tiny_model: str,
    stores: Stores,
    tp1_tokens_of_other_prompts: list[list[int]],
    tp1_tokens_in_redis: list[list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    """A TP=2 engine, CPU offload in front of shared storage and Redis, in two passes.

    The first pass asks for OTHER_PROMPTS (stored at TP=1 in shared storage,
    some shards damaged or missing), PROMPTS (new: every tier stores them)
    and REDIS_PROMPTS (stored at TP=1 in Redis only); the second, after
    vLLM's prefix cache was emptied, for PROMPTS again: CPU offload (the
    first tier) serves it on both ranks.
    """
    connectors = (
        {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_extra_config": {"cpu_pool_bytes": "64MiB"},
        },
        shared_storage(stores.directory),
        redis(stores.redis_url, stores.key_prefix),
    )
    return run_engine_process(
        tiny_model,
        kvwire_transfer_config(profile(*connectors)),
        PROMPTS,
        MAX_TOKENS,
        tmp_path_factory.mktemp("tp2-engine"),
        env=TP2_ENV,
        engine_args=TP2,
        prompt_passes=[OTHER_PROMPTS + PROMPTS + REDIS_PROMPTS, PROMPTS],
        timeout_s=TP2_TIMEOUT_S,
    )


@pytest.mark.slow
def test_tp2_tokens_equal_tp1_and_the_warm_pass_is_served_by_cpu_offload(
    tp2_run: Any, tokens_without_connector: list[list[int]]
) -> None:
    first, warm = tp2_run["tokens"]
    assert first[len(OTHER_PROMPTS) : len(OTHER_PROMPTS) + len(PROMPTS)] == tokens_without_connector
    assert warm == tokens_without_connector
    assert tp2_run["cached"][1] == [LOADABLE_TOKENS] * len(PROMPTS)
    loadable_blocks = LOADABLE_TOKENS // BLOCK_SIZE * len(PROMPTS)
    # Each rank loaded every block from its CPU pool (the ranks' counters are summed:
    # an entry counts on the rank that moved it) ...
    assert tp2_run["stats"]["CPUOffloadConnector.blocks_loaded"] == 2 * loadable_blocks
    # ... and each lookup once (the scheduler side made it; only rank 0 reports it).
    assert tp2_run["stats"]["CPUOffloadConnector.lookup_hit_blocks"] == loadable_blocks


@pytest.mark.slow
def test_tp2_loads_what_tp1_stored_in_redis(
    tp2_run: Any, tp1_tokens_in_redis: list[list[int]]
) -> None:
    start = len(OTHER_PROMPTS) + len(PROMPTS)
    assert tp2_run["tokens"][0][start:] == tp1_tokens_in_redis
    assert tp2_run["cached"][0][start:] == [LOADABLE_TOKENS] * len(REDIS_PROMPTS)


@pytest.mark.slow
def test_tp2_loads_what_tp1_stored_and_a_damaged_or_missing_shard_costs_the_block(
    tp2_run: Any, tp1_tokens_of_other_prompts: list[list[int]]
) -> None:
    """The third prompt loads whole across sizes. The first's blocks fail on rank 1 only:
    vLLM fails them on both ranks and computes them again. The second's blocks lack rank 0's
    entries: a miss for the whole block, though rank 1's are there. Tokens as at TP=1."""
    first_pass = tp2_run["tokens"][0][: len(OTHER_PROMPTS)]
    cached = tp2_run["cached"][0][: len(OTHER_PROMPTS)]
    assert first_pass == tp1_tokens_of_other_prompts
    assert cached[1] == 0
    assert cached[2] == LOADABLE_TOKENS
    assert tp2_run["stats"]["SharedStorageConnector.load_errors"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("store", ["shared_storage", "redis"])
def test_a_tp1_engine_loads_what_the_tp2_engine_stored(
    store: str,
    tp2_run: Any,
    stores: Stores,
    tiny_model: str,
    tokens_without_connector: list[list[int]],
) -> None:
    connector = (
        shared_storage(stores.directory)
        if store == "shared_storage"
        else redis(stores.redis_url, stores.key_prefix)
    )
    with running_llm(tiny_model, kvwire_transfer_config(profile(connector))) as llm:
        tokens, cached = generate(llm, PROMPTS)
    assert tokens == tokens_without_connector
    assert cached == [LOADABLE_TOKENS] * len(PROMPTS)


@pytest.fixture(scope="module")
def pp2_run(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, pathlib.Path]:
    """A PP=2 engine (compiled: vLLM's eager mode fails at PP=2), CPU offload in front of
    shared storage at one layer per entry: two passes over PROMPTS, the second after vLLM's
    prefix cache was emptied. Each stage holds one of the model's two layers."""
    store = tmp_path_factory.mktemp("pp2-store")
    connectors = (
        {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_extra_config": {"cpu_pool_bytes": "64MiB"},
        },
        one_layer_entries(shared_storage(store)),
    )
    result = run_engine_process(
        tiny_model,
        kvwire_transfer_config(profile(*connectors)),
        PROMPTS,
        MAX_TOKENS,
        tmp_path_factory.mktemp("pp2-engine"),
        env=TP2_ENV,
        passes=2,
        engine_args={**PP2, "enforce_eager": False},
        timeout_s=TP2_TIMEOUT_S,
    )
    return result, store


def one_layer_entries(connector: dict[str, Any]) -> dict[str, Any]:
    connector["kv_connector_extra_config"]["entry_layers"] = 1
    return connector


@pytest.mark.slow
def test_pp2_tokens_equal_pp1_and_a_pp1_engine_loads_what_it_stored(
    pp2_run: tuple[Any, pathlib.Path], tiny_model: str, tokens_without_connector: list[list[int]]
) -> None:
    result, store = pp2_run
    cold, warm = result["tokens"]
    assert cold == tokens_without_connector
    assert warm == tokens_without_connector
    # The warm pass is served by CPU offload, each stage loading its layer.
    assert result["cached"][1] == [LOADABLE_TOKENS] * len(PROMPTS)
    loadable_blocks = LOADABLE_TOKENS // BLOCK_SIZE * len(PROMPTS)
    assert result["stats"]["CPUOffloadConnector.blocks_loaded"] == 2 * loadable_blocks
    connector = one_layer_entries(shared_storage(store))
    with running_llm(tiny_model, kvwire_transfer_config(profile(connector))) as llm:
        tokens, cached = generate(llm, PROMPTS)
    assert tokens == tokens_without_connector
    assert cached == [LOADABLE_TOKENS] * len(PROMPTS)
