"""How well KV tiers decide under ``vllm serve``: traffic shaped like serving, replayed in
order by vLLM's own client, against the limit and Belady's optimum.

``.venv-vllm/bin/python -m benchmarks --only serve-tiers [--quick]`` (the vLLM
venv: ``make .venv-vllm/.kvwire-installed``, plus pandas, which vLLM's
``custom`` dataset reads JSONL with). The trace is :mod:`benchmarks.tiers`'s
generator (seeded): Zipf-popular system prompts and documents shared by many
requests, multi-turn sessions whose prompt grows by a few blocks each turn,
one-off prompts. Each block of 32 tokens (vLLM's CPU attention takes no
fewer) becomes 32 words of the served model's word-level tokenizer
(``t<id>``, one token each, :func:`benchmarks.vllm.build_model`): the first
two spell the block's number, the rest are drawn from a generator seeded by
it. A trace block's number names its whole prefix, as an engine's block hash
does, so two prompts share vLLM's first ``k`` blocks exactly when they share
the trace's first ``k``. Every prompt ends with one word more, so that its
last whole block can be a hit too (vLLM computes at least a prompt's last
token). The tokenizer is checked to read every prompt back as its tokens,
and the limit's computed prompt tokens (``/metrics``) to equal the trace's
distinct blocks' tokens plus one word per prompt. The prompts go to vLLM's
``custom`` dataset (JSONL, ``{"prompt": ..., "output_tokens": 2}`` a line),
which ``--disable-shuffle`` keeps in the trace's order and
``--skip-chat-template`` as written; one request at a time, so a session's
next turn comes after its last one's answer, as a user's would.

Configurations (``CONFIGURATIONS``; one server each, the same trace, once a
round; ``--quick`` a smaller trace and one configuration of each kind;
``python -m benchmarks.serve_tiers --kinds none cpu`` only those kinds, and
the limit): the limit
(no connector, vLLM's KV cache holds every block of the trace); no connector
on a small KV cache (about the longest prompt's blocks; the same for every
connector, so what they keep matters); a MultiConnector of the CPU offload
connector and shared storage, every computed block written to both, LRU (the
tiered-disk profile before the tiered connector); the tiered offload
connector (``TieredOffloadConnector``: a CPU pool in front of a directory)
under several eviction and write policies (``write_through``, ``spill``),
one that reads the disk's blocks straight into the cache
(``promotion: never``), one whose pool takes only blocks saved twice and
writes the others to the disk from the cache (``save_threshold`` 2,
``write_around``), then the one of the first whose pool hit the most blocks
again with ``save_threshold`` 2; shared storage alone and vLLM's
ExampleConnector (``REDIS_CONFIGURATIONS``, over a redis-server, are
:mod:`benchmarks.serve_paired`'s, not these rounds'). Every
CPU pool holds ``Workload.primary_blocks`` blocks, a fraction of the trace's
distinct blocks. A configuration whose server does not start, or whose
client fails, is reported failed with the line of its log that says why; the
others still run.

Reported per configuration: the client's request and output throughput and
mean TTFT, each over the limit's; from ``/metrics``, prompt tokens by source
(computed, vLLM's prefix cache, loaded by the connector) and kvwire's
counters by tier (a tiered connector's primary under the CPU pool's names,
its secondary under ``tier1.``; a MultiConnector's under each child's name):
bytes written and hit blocks per tier, load errors; the CPU seconds kvwire's
own threads took while serving (:mod:`benchmarks.thread_cpu`: what its copies
cost, which the host's noise moves little); the warnings the server logged
while serving; and whether the greedy outputs equal the limit's. The
CPU pool's hit rate (its hit blocks over every block of the trace) is set
beside Belady's offline optimum (:func:`benchmarks.tiers.belady_hits`) for a
cache of the pool's size, on every block of the trace, and on the blocks
vLLM's own cache misses (``vllm_cache_misses``, a model of vLLM's cache,
checked against the no-connector server's computed tokens): the blocks a
connector is asked for, the fairer bound.

Writes ``serve-tiers.json``, ``serve-tiers.md`` (the README's table) and
``serve-tiers.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import random
import re
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from benchmarks import tiers
from benchmarks.common import MIB, pyplot, write_json
from benchmarks.rounds import (
    FULL_REPEATS,
    QUICK_REPEATS,
    agreed,
    agreed_cell,
    default_repeats,
    interleaved,
    positive_int,
    rounds_label,
    spread,
    spread_cell,
)
from benchmarks.serve import (
    CLIENT_FIGURES,
    MODEL_SHAPE,
    BenchClient,
    ServerSpec,
    difference,
    scrape,
    vllm_servers,
)
from benchmarks.thread_cpu import kvwire_cpu_seconds
from kvwire.blocks.format import HEADER_SIZE

NAME = "serve-tiers"
# vLLM's CPU attention takes blocks of a multiple of 32 tokens only.
BLOCK_SIZE = 32
# --only serve's model with 4 layers, not 16 (8 KiB of KV per token): ten servers each
# serve the whole trace, one core each, within about 25 minutes.
SHAPE = MODEL_SHAPE | {"num_hidden_layers": 4}
KV_BYTES_PER_TOKEN = (
    2
    * SHAPE["num_hidden_layers"]
    * SHAPE["num_key_value_heads"]
    * (SHAPE["hidden_size"] // SHAPE["num_attention_heads"])
    * 4  # float32
)
BLOCK_BYTES = BLOCK_SIZE * KV_BYTES_PER_TOKEN
# The tokenizer's words are t<id> (benchmarks.vllm); t0, t1 and t2 are its unknown, BOS
# and EOS words, matched inside any word before words are split, so "t2334" reads as two
# tokens. Prompts use only the words that start with none of them, and of at most three
# digits, so that a word and its space are no longer than the longest word ("t4095"):
# vLLM refuses a prompt of more characters than max_model_len times that.
WORDS = tuple(token for token in range(3, 1000) if str(token)[0] not in "012")
TAIL_WORD = WORDS[0]
LONGEST_WORD_CHARS = len(f"t{SHAPE['vocab_size'] - 1}")
LOG_TAIL_CHARS = 3000


@attrs.frozen
class Workload:
    """The trace, the tiers' sizes (in blocks) and what the client sends."""

    trace: tiers.TraceShape
    primary_blocks: int
    """The CPU pool of every connector (its slots), and Belady's cache."""
    vllm_cache_blocks: int
    """vLLM's own KV cache but the limit's; raised to hold the longest prompt if needed."""
    output_len: int = 2
    concurrency: int = 1
    """Requests in flight; ``vllm_cache_misses`` models vLLM's cache at 1 only."""


# 600 requests: about 11k block accesses, 4.5k distinct blocks (18 times the pool).
FULL = Workload(
    trace=attrs.evolve(tiers.FULL, requests=600, capacities=(256,)),
    primary_blocks=256,
    vllm_cache_blocks=96,
)
# 100 requests: about 1.8k block accesses, 830 distinct blocks (13 times the pool).
QUICK = Workload(
    trace=attrs.evolve(tiers.FULL, requests=100, capacities=(64,)),
    primary_blocks=64,
    vllm_cache_blocks=48,
)

LIMIT = "the limit: vLLM, KV cache for everything"
NO_CONNECTOR = "no connector"
BEST = "best"
"""A tiered row's eviction and write policy: those of the save_threshold 1 row whose CPU pool
hit the most blocks (``best_of``)."""


@attrs.frozen
class Configuration:
    """One server's setup; ``kind`` says which connector, the rest tune a tiered one."""

    name: str
    kind: str
    eviction: str = "kvfifo"
    save_threshold: int = 1
    write_policy: str = "write_through"
    quick: bool = False
    """Whether --quick runs it too: one configuration of each kind keeps it short."""
    promotion: str = "always"
    write_around: bool = False
    tier: str = "disk"
    """A tiered configuration's secondary tier: ``disk`` (a directory) or ``redis``."""
    page_cache: str = "keep"
    """The directory's ``page_cache``: ``drop`` keeps its entries out of the page cache,
    a disk whose every read comes from the device."""
    vllm_cache: str = "small"
    """vLLM's own KV cache: ``small`` (``Workload.vllm_cache_blocks``), or ``limit``, the
    limit's, which holds every block: the connector then loads nothing, and what it costs
    beside the limit is its lookups, its saves and vLLM's connector calls."""

    @property
    def label(self) -> str:
        """A short name for command lines: the kind, and a tiered one's settings."""
        # What sets the configuration's surroundings apart: its disk's page cache, vLLM's cache.
        surroundings = "" if self.page_cache == "keep" else f"-page-cache-{self.page_cache}"
        if self.vllm_cache != "small":
            surroundings += f"-{self.vllm_cache}-cache"
        if self.kind != "tiered":
            return self.kind + surroundings
        label = f"tiered-{self.eviction}-{self.write_policy.replace('_', '-')}"
        if self.tier != "disk":
            label += f"-{self.tier}"
        if self.promotion != "always":
            label += f"-promotion-{self.promotion}"
        if self.save_threshold != 1:
            label += f"-threshold-{self.save_threshold}"
        if self.write_around:
            label += "-write-around"
        return label + surroundings


def tiered(
    eviction: str,
    write_policy: str,
    save_threshold: int = 1,
    quick: bool = False,
    promotion: str = "always",
    write_around: bool = False,
    tier: str = "disk",
    page_cache: str = "keep",
    vllm_cache: str = "small",
) -> Configuration:
    label = "the best above" if eviction == BEST else f"{eviction} {write_policy}"
    if tier == "redis":
        label += ", Redis"
    if promotion != "always":
        label += f", promotion {promotion}"
    if write_around:
        label += ", write_around"
    if page_cache != "keep":
        label += f", page_cache {page_cache}"
    if vllm_cache != "small":
        label += f", vLLM's cache the {vllm_cache}'s"
    return Configuration(
        f"tiered: {label}, save_threshold {save_threshold}",
        "tiered",
        eviction,
        save_threshold,
        write_policy,
        quick,
        promotion,
        write_around,
        tier,
        page_cache,
        vllm_cache,
    )


# Run in this order, and in reverse every other round (benchmarks.rounds): a BEST row after
# the rows it picks from, or, in a reversed round, with the pick of the round before.
CONFIGURATIONS = (
    Configuration(LIMIT, "limit", quick=True),
    Configuration(NO_CONNECTOR, "none", quick=True),
    Configuration("MultiConnector write-through LRU (the old tiered-disk)", "multi", quick=True),
    Configuration("kvwire CPU offload alone (the pool, no disk)", "cpu", quick=True),
    tiered("lru", "write_through"),
    tiered("lru", "spill"),
    tiered("arc", "write_through"),
    tiered("arc", "spill"),
    tiered("s3fifo", "spill"),
    tiered("kvfifo", "spill"),
    tiered("kvfifo", "write_through"),
    # Tier hits read straight into the cache: the pool keeps only the blocks saved.
    tiered("kvfifo", "spill", promotion="never"),
    # The tiered-disk profile's policies: the blocks seen once go to the disk alone, and
    # the pool copies only those seen again.
    tiered("kvfifo", "spill", save_threshold=2, write_around=True, quick=True),
    tiered(BEST, BEST, save_threshold=2),
    Configuration("kvwire shared storage alone", "shared-storage", quick=True),
    Configuration("vLLM ExampleConnector", "example", quick=True),
)
KINDS = ("limit", "none", "cpu", "multi", "tiered", "shared-storage", "example")
# Configurations whose slow tier is Redis: a redis-server started for them. The
# paired benchmark (benchmarks.serve_paired) runs them; these rounds do not.
REDIS_CONFIGURATIONS = (
    Configuration("kvwire Redis alone", "redis"),
    # The tiered-redis profile's policies, and a pool spilling to Redis.
    tiered("kvfifo", "write_through", tier="redis"),
    tiered("kvfifo", "spill", tier="redis"),
    tiered("kvfifo", "spill", save_threshold=2, write_around=True, tier="redis"),
)
# Configurations whose disk keeps its entries out of the page cache, so that every read
# comes from the device: the paired benchmark runs them; these rounds do not.
COLD_DISK_CONFIGURATIONS = (
    Configuration(
        "kvwire shared storage alone, page_cache drop", "shared-storage", page_cache="drop"
    ),
    tiered("kvfifo", "spill", page_cache="drop"),
    tiered("kvfifo", "spill", promotion="never", page_cache="drop"),
    tiered("kvfifo", "spill", save_threshold=2, write_around=True, page_cache="drop"),
)
# Configurations whose vLLM cache is the limit's, so that they load nothing: beside the
# limit, what the connector costs without its loads (the CPU pool's: its calls and its
# copies into memory; a disk's: its writes too). The paired benchmark runs them.
LIMIT_CACHE_CONFIGURATIONS = (
    Configuration("kvwire CPU offload alone, vLLM's cache the limit's", "cpu", vllm_cache="limit"),
    Configuration(
        "kvwire shared storage alone, vLLM's cache the limit's",
        "shared-storage",
        vllm_cache="limit",
    ),
    tiered("kvfifo", "spill", save_threshold=2, write_around=True, vllm_cache="limit"),
)
# The kinds whose primary tier is a CPU pool of Workload.primary_blocks.
POOLED_KINDS = ("cpu", "multi", "tiered")
# Each kind's tiers: a label and the prefix of its counters' names (as /metrics spells
# them: kvwire's "." becomes "_"); the primary first, its counters unprefixed where "".
TIER_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "cpu": (("CPU", ""),),
    "multi": (("CPU", "CPUOffloadConnector_"), ("disk", "SharedStorageConnector_")),
    "tiered": (("CPU", ""), ("disk", "tier1_")),
    "shared-storage": (("disk", ""),),
}


# ------------------------------------------------------------------ the trace as prompts


def block_tokens(block: bytes) -> list[int]:
    """The token ids of a trace block: two spell its number, the rest follow from it."""
    number = int.from_bytes(block, "big")
    high, low = divmod(number, len(WORDS))
    if high >= len(WORDS):
        raise ValueError(f"block {number} is past the {len(WORDS) ** 2} blocks two words name")
    rng = random.Random(number)
    return [WORDS[high], WORDS[low], *rng.choices(WORDS, k=BLOCK_SIZE - 2)]


def prompt_tokens(hashes: Sequence[bytes]) -> list[int]:
    """A request's prompt: its blocks' tokens and one word after (never a whole block)."""
    return [token for block in hashes for token in block_tokens(block)] + [TAIL_WORD]


def prompt_text(tokens: Iterable[int]) -> str:
    """What the word-level tokenizer reads back as ``tokens``."""
    return " ".join(f"t{token}" for token in tokens)


def write_dataset(path: pathlib.Path, prompts: Iterable[Sequence[int]], output_len: int) -> None:
    """vLLM's ``custom`` JSONL dataset of the prompts, one a line, in order."""
    with path.open("w") as file:
        for tokens in prompts:
            file.write(json.dumps({"prompt": prompt_text(tokens), "output_tokens": output_len}))
            file.write("\n")


def check_tokenizer(model: str, prompts: Sequence[Sequence[int]]) -> None:
    """Raise unless the served model's tokenizer reads every prompt back as its tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    for index, tokens in enumerate(prompts):
        read = tokenizer(prompt_text(tokens)).input_ids
        if read != list(tokens):
            raise RuntimeError(
                f"prompt {index}: the tokenizer reads {len(read)} tokens "
                f"{read[:8]}..., expected {len(tokens)} {list(tokens[:8])}..."
            )


def vllm_cache_misses(trace: tiers.Trace, cache_blocks: int) -> tiers.Trace:
    """Each request's blocks past its hit in vLLM's own prefix cache of ``cache_blocks``.

    A model of vLLM's cache serving one request at a time: a request uses the
    longest prefix of its blocks the cache holds, then takes a free block for
    each other block and one for its last word and output, the least recently
    freed first (that block's old contents leave the cache); when it ends, its
    blocks are freed last block first, so a prefix leaves the cache from its
    tail, and the block of its last word, which caches nothing, is taken
    first. One block is vLLM's null block. The blocks it misses are those a
    connector is asked for.
    """
    # Free blocks by id, least recently freed first, each with the block it caches (or None).
    free: OrderedDict[int, bytes | None] = OrderedDict.fromkeys(range(cache_blocks - 1))
    cached: dict[bytes, int] = {}
    misses: tiers.Trace = []
    for hashes in trace:
        hit = 0
        while hit < len(hashes) and hashes[hit] in cached:
            hit += 1
        used = [cached[block] for block in hashes[:hit]]
        for block_id in used:
            del free[block_id]
        contents: list[bytes | None] = [*hashes[:hit]]
        for block in [*hashes[hit:], None]:
            block_id, old = free.popitem(last=False)
            if old is not None:
                del cached[old]
            if block is not None:
                cached[block] = block_id
            used.append(block_id)
            contents.append(block)
        for block_id, block in zip(reversed(used), reversed(contents), strict=True):
            free[block_id] = block
            if block is None:  # a block caching nothing is taken again first
                free.move_to_end(block_id, last=False)
        misses.append(hashes[hit:])
    return misses


def trace_facts(trace: tiers.Trace, primary_blocks: int, vllm_cache_blocks: int) -> dict[str, Any]:
    """The trace's sizes, and Belady's hit rates on its block sequence.

    Hit rates are over every block of every request. Belady's at the primary's
    size sees every block, as if no cache were in front of the primary; behind
    vLLM's cache it sees what that cache misses (``vllm_cache_misses``), as the
    primary does.
    """
    accesses = [block for hashes in trace for block in hashes]
    distinct = len(set(accesses))
    behind = [block for hashes in vllm_cache_misses(trace, vllm_cache_blocks) for block in hashes]
    return {
        "requests": len(trace),
        "block_accesses": len(accesses),
        "distinct_blocks": distinct,
        "longest_prompt_blocks": max(len(hashes) for hashes in trace),
        "prompt_tokens": len(accesses) * BLOCK_SIZE + len(trace),
        # What the limit computes: each distinct block once, each prompt's last word.
        "limit_computed_tokens": distinct * BLOCK_SIZE + len(trace),
        # What vLLM alone computes on its small cache, as vllm_cache_misses models it.
        "no_connector_computed_tokens": len(behind) * BLOCK_SIZE + len(trace),
        "working_set_over_primary": distinct / primary_blocks,
        "reuse_hit_rate": 1 - distinct / len(accesses),
        "vllm_cache_hit_rate": 1 - len(behind) / len(accesses),
        "belady_primary_hit_rate": tiers.belady_hits(accesses, primary_blocks) / len(accesses),
        "belady_primary_behind_vllm_hit_rate": tiers.belady_hits(behind, primary_blocks)
        / len(accesses),
    }


def server_sizes(workload: Workload, trace: tiers.Trace, longest_chars: int) -> dict[str, int]:
    """``max_model_len``, and the KV caches (in blocks) of the servers but the limit and of it."""
    longest = max(len(hashes) for hashes in trace)
    tokens = (longest + 1) * BLOCK_SIZE + workload.output_len
    # vLLM refuses a prompt of more characters than max_model_len times its longest word.
    max_model_len = max(tokens, -(-longest_chars // LONGEST_WORD_CHARS))
    # It also refuses a server whose cache cannot hold one request of max_model_len.
    vllm_cache_blocks = max(workload.vllm_cache_blocks, -(-max_model_len // BLOCK_SIZE) + 1)
    distinct = len({block for hashes in trace for block in hashes})
    return {
        "max_model_len": max_model_len,
        "vllm_cache_blocks": vllm_cache_blocks,
        # Every distinct block, and room for the running request beside them.
        "limit_cache_blocks": distinct * 5 // 4 + vllm_cache_blocks,
    }


# ------------------------------------------------------------------ the servers


def served_trace(workload: Workload) -> tuple[tiers.Trace, list[list[int]], dict[str, int]]:
    """The workload's trace, each request's prompt tokens, and the servers' sizes for them."""
    trace = tiers.generate_trace(workload.trace)
    prompts = [prompt_tokens(hashes) for hashes in trace]
    return trace, prompts, server_sizes(workload, trace, max(map(len, map(prompt_text, prompts))))


def pool_bytes(blocks: int) -> int:
    """``cpu_pool_bytes`` for a pool of exactly ``blocks`` slots."""
    # A slot holds a block of every layer and the entry's header.
    return blocks * (BLOCK_BYTES + HEADER_SIZE)


def needs_redis(config: Configuration) -> bool:
    """Whether a configuration keeps blocks in Redis (``transfer_config`` needs a server)."""
    return config.kind == "redis" or (config.kind == "tiered" and config.tier == "redis")


def transfer_config(
    config: Configuration,
    scratch: pathlib.Path,
    primary_blocks: int,
    redis_url: str | None = None,
) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for a configuration; each store in a directory of its own
    (in Redis, under a key prefix of its own: ``redis_url`` is the server's)."""
    if config.kind in ("limit", "none"):
        return None
    directory = str(scratch / config.name.translate(str.maketrans(" :,()'", "------")))
    redis: dict[str, Any] = {}
    if needs_redis(config):
        if redis_url is None:
            raise ValueError(f"{config.name}: keeps blocks in Redis, and no redis_url was given")
        # The tiered-redis profile's tier options; the server and a prefix of this store's.
        redis = shipped_profile("tiered-redis")["kv_transfer_config"]["kv_connector_extra_config"][
            "tiers"
        ][0]
        redis.update(url=redis_url, key_prefix=f"kvwire-{scratch.name}-{config.label}:")
    if config.kind == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"shared_storage_path": directory},
        }
    # The disk's options are the shipped profiles' (no fsync, 4 I/O threads) in every row;
    # its page cache kept but where a configuration says drop.
    disk = {
        "shared_storage_path": directory,
        "fsync": False,
        "io_threads": 4,
        "page_cache": config.page_cache,
    }
    if config.kind == "multi":
        # A CPU pool and a disk composed by MultiConnector: what the tiered connector replaces.
        profile = {
            "kv_transfer_config": {
                "kv_connector": "MultiConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "connectors": [
                        {
                            "kv_connector": "CPUOffloadConnector",
                            "kv_connector_extra_config": {
                                "cpu_pool_bytes": pool_bytes(primary_blocks),
                                "io_threads": 2,
                                "eviction": "lru",
                            },
                        },
                        {
                            "kv_connector": "SharedStorageConnector",
                            "kv_connector_extra_config": disk,
                        },
                    ]
                },
            }
        }
    elif config.kind == "cpu":
        profile = shipped_profile("cpu-offload")
        options = profile["kv_transfer_config"]["kv_connector_extra_config"]
        options["cpu_pool_bytes"] = pool_bytes(primary_blocks)
    elif config.kind == "shared-storage":
        profile = shipped_profile("shared-storage")
        options = profile["kv_transfer_config"]["kv_connector_extra_config"]
        options.update(shared_storage_path=directory, page_cache=config.page_cache)
    elif config.kind == "redis":
        profile = shipped_profile("redis")
        options = profile["kv_transfer_config"]["kv_connector_extra_config"]
        options.update((key, value) for key, value in redis.items() if key in options)
    elif config.kind == "tiered":
        profile = {
            "kv_transfer_config": {
                "kv_connector": "TieredOffloadConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "cpu_pool_bytes": pool_bytes(primary_blocks),
                    "io_threads": 2,
                    "eviction": config.eviction,
                    "save_threshold": config.save_threshold,
                    "write_policy": config.write_policy,
                    "promotion": config.promotion,
                    "write_around": config.write_around,
                    "tiers": [redis if redis else {"medium": "directory", **disk}],
                },
            }
        }
    else:
        raise ValueError(f"unknown kind {config.kind!r}: expected one of {KINDS}")
    return {
        "kv_connector": "KVWireConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvwire": profile},
    }


def shipped_profile(name: str) -> dict[str, Any]:
    import yaml

    from kvwire.config.profile import shipped_profile_path

    profile: dict[str, Any] = yaml.safe_load(shipped_profile_path(name).read_text())
    return profile


def server_args(
    model: str, kv_cache_blocks: int, max_model_len: int, transfer: dict[str, Any] | None
) -> list[str]:
    args = [
        *("--model", model, "--seed", "0", "--dtype", "float32"),
        *("--block-size", str(BLOCK_SIZE), "--max-model-len", str(max_model_len)),
        *("--enforce-eager", "--enable-prefix-caching"),
        *("--kv-cache-memory-bytes", str(kv_cache_blocks * BLOCK_BYTES)),
        # One prompt at most is prefilled at once (one request at a time): in one step.
        *("--max-num-batched-tokens", str(max_model_len)),
    ]
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return args


def server_spec(
    model: str,
    config: Configuration,
    sizes: Mapping[str, int],
    transfer: dict[str, Any] | None,
    log: pathlib.Path,
) -> ServerSpec:
    """A configuration's ``vllm serve`` (``server_sizes``): the limit's cache holds every block."""
    cache_blocks = (
        sizes["limit_cache_blocks"]
        if config.kind == "limit" or config.vllm_cache == "limit"
        else sizes["vllm_cache_blocks"]
    )
    return ServerSpec(
        server_args(model, cache_blocks, sizes["max_model_len"], transfer),
        # The model on one core of its own, whatever the connector (as --only serve).
        {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        log,
    )


def client_args(
    model: str, target: str, dataset: pathlib.Path, workload: Workload, result_path: pathlib.Path
) -> list[str]:
    """``vllm bench serve`` over the trace's dataset, in its order, one request at a time."""
    return [
        *("--backend", "openai", "--base-url", target, "--endpoint", "/v1/completions"),
        *("--model", model, "--tokenizer", model, "--seed", "0"),
        *("--dataset-name", "custom", "--dataset-path", str(dataset)),
        *("--disable-shuffle", "--skip-chat-template"),
        *("--num-prompts", str(workload.trace.requests)),
        *("--custom-output-len", str(workload.output_len)),
        *("--max-concurrency", str(workload.concurrency), "--temperature", "0"),
        *("--ignore-eos", "--percentile-metrics", "ttft,tpot,e2el"),
        # The server is up (health checked); a test request would be one more prefix.
        *("--ready-check-timeout-sec", "0"),
        *("--metric-percentiles", "50,99", "--save-result", "--save-detailed"),
        *("--result-dir", str(result_path.parent), "--result-filename", result_path.name),
    ]


class Bench:
    """Runs each configuration's server under vLLM's client, the same dataset for each."""

    def __init__(
        self,
        model: str,
        workload: Workload,
        dataset: pathlib.Path,
        scratch: pathlib.Path,
        sizes: Mapping[str, int],
    ) -> None:
        self.model = model
        self.workload = workload
        self.dataset = dataset
        self.scratch = scratch
        self.sizes = sizes
        self.client = BenchClient(scratch / "client.log")

    def close(self) -> None:
        self.client.close()

    def measure(self, config: Configuration) -> dict[str, Any]:
        """One configuration on a fresh server and empty stores: its figures, or why it failed."""
        print(f"  {config.name}", flush=True)
        started = time.monotonic()
        log = self.scratch / f"server-{len(list(self.scratch.glob('server-*')))}.log"
        # Each round starts from empty stores: nothing an earlier round saved is found.
        stores = pathlib.Path(tempfile.mkdtemp(prefix="stores-", dir=self.scratch))
        transfer = transfer_config(config, stores, self.workload.primary_blocks)
        spec = server_spec(self.model, config, self.sizes, transfer, log)
        row: dict[str, Any] = {"kind": config.kind, "transfer_config": transfer}
        if config.kind == "tiered":
            row.update(
                eviction=config.eviction,
                save_threshold=config.save_threshold,
                write_policy=config.write_policy,
                promotion=config.promotion,
                write_around=config.write_around,
            )
        served = False
        try:
            with vllm_servers([spec]) as (url,):
                served = True
                row.update(self.drive(url, log))
        except Exception as error:  # one configuration's failure is reported, not fatal
            message = f"{type(error).__name__}: {error}"
            reason = root_cause(message)
            print(f"    failed: {reason}", flush=True)
            row.update(status="failed", reason=reason, error=message[-LOG_TAIL_CHARS:])
            if served:
                # The client may have been stopped (it overran) or be mid-run: a fresh one.
                self.client.close()
                self.client = BenchClient(self.scratch / f"client-{time.monotonic_ns()}.log")
        finally:
            shutil.rmtree(stores, ignore_errors=True)
        row["wall_seconds"] = round(time.monotonic() - started, 1)
        return row

    def drive(self, url: str, log: pathlib.Path) -> dict[str, Any]:
        before = scrape(url)
        port = int(url.rpartition(":")[2])
        kvwire_cpu_before = kvwire_cpu_seconds(port)
        log_start = log.stat().st_size
        result_path = self.scratch / f"client-{time.monotonic_ns()}.json"
        self.client.run(client_args(self.model, url, self.dataset, self.workload, result_path))
        # The server counts a request's tokens once it ends: the client has seen every end.
        counters = difference(before, scrape(url))
        kvwire_cpu_after = kvwire_cpu_seconds(port)
        result: dict[str, Any] = json.loads(result_path.read_text())
        errors = [error for error in result.get("errors", []) if error]
        print(
            f"    {result['request_throughput']:.2f} req/s, mean TTFT "
            f"{result['mean_ttft_ms']:.0f} ms, {result['failed']} failed, "
            f"{counters.get('prompt_tokens_local_compute', 0):.0f} prompt tokens computed",
            flush=True,
        )
        return {
            "status": "ok",
            "client": {key: result[key] for key in CLIENT_FIGURES},
            "first_errors": [error[-300:] for error in errors[:3]],
            "generated_texts": result["generated_texts"],
            "server": counters,
            "kvwire_cpu_seconds": (
                None
                if kvwire_cpu_before is None or kvwire_cpu_after is None
                else round(kvwire_cpu_after - kvwire_cpu_before, 2)
            ),
            # What the server warned of while it served the trace (not at its start).
            "log_warnings": log_warnings(log_since(log, log_start)),
        }


def log_since(log: pathlib.Path, offset: int) -> str:
    with log.open("rb") as file:
        file.seek(offset)
        return file.read().decode(errors="replace")


def log_warnings(text: str, most: int = 20) -> list[str]:
    """The distinct warnings and errors of a server's log, in order, each with its count.

    Lines that differ only in numbers count as one.
    """
    counts: dict[str, list[Any]] = {}
    for line in text.splitlines():
        if " WARNING " not in line and " ERROR " not in line:
            continue
        message = line.split("] ", 1)[-1].strip()
        key = re.sub(r"\d+", "N", message)
        if key in counts:
            counts[key][1] += 1
        else:
            counts[key] = [message[:300], 1]
    return [f"{message} (x{count})" for message, count in list(counts.values())[:most]]


def root_cause(message: str) -> str:
    """The line of a failed server's log that says why: its first error logged with a type."""
    lines = message.splitlines()
    for line in lines:
        if " ERROR " in line and re.search(r"\b\w+(Error|Exception): ", line):
            return line.split("] ", 1)[-1].strip()[:300]
    typed = [line for line in lines if re.match(r"\w+(Error|Exception): ", line)]
    return (typed[-1] if typed else lines[0] if lines else "?")[:300]


def best_of(rows: Mapping[str, dict[str, Any]]) -> tuple[str, str] | None:
    """The eviction and write policy of the save_threshold 1 tiered row whose pool hit most.

    The pool's hits, not the computed tokens: behind it the disk gives nearly every
    other reuse, so the computed tokens barely tell the policies apart. Ties go to
    the row that computed fewer tokens.
    """
    candidates = [
        row
        for row in rows.values()
        if row["kind"] == "tiered" and row.get("save_threshold") == 1 and row["status"] == "ok"
    ]
    if not candidates:
        return None

    def merit(row: dict[str, Any]) -> tuple[float, float]:
        pool_hits = tier_hits("tiered", tier_counters(row["server"], "tiered"))[0]
        return pool_hits, -row["server"].get("prompt_tokens_local_compute", 0)

    best = max(candidates, key=merit)
    return best["eviction"], best["write_policy"]


def run(
    output_dir: pathlib.Path,
    quick: bool,
    repeats: int | None = None,
    kinds: Sequence[str] = KINDS,
) -> dict[str, Any]:
    """Every configuration (one of each kind with ``quick``) of ``kinds``, the limit always."""
    repeats = default_repeats(quick, repeats)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"kinds: {unknown} are not configurations' kinds; expected of {KINDS}")
    chosen = [
        config
        for config in CONFIGURATIONS
        if (config.quick or not quick) and (config.kind in kinds or config.kind == "limit")
    ]
    return measure_tiers(output_dir, QUICK if quick else FULL, chosen, repeats)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.serve_tiers [--quick] [--repeats N] [--kinds KIND ...]``.

    ``--kinds`` runs only those configurations (and the limit, which every
    ratio needs): rounds of two configurations are what sets them apart.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_tiers")
    parser.add_argument("--quick", action="store_true", help="the 100-request trace")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        help=f"interleaved rounds (default {FULL_REPEATS}; {QUICK_REPEATS} with --quick)",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="the kinds of configuration to run (the limit always runs)",
    )
    parser.add_argument(
        "--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks/results")
    )
    args = parser.parse_args(argv)
    summary = run(args.output_dir, args.quick, args.repeats, args.kinds)
    print(json.dumps(summary, indent=2))
    return 0


def measure_tiers(
    output_dir: pathlib.Path,
    workload: Workload,
    configurations: Sequence[Configuration],
    repeats: int,
) -> dict[str, Any]:
    """Every configuration on the workload's trace, in ``repeats`` interleaved rounds.

    Writes ``serve-tiers.json/.md/.png``.
    """
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"the {NAME} benchmark runs in the vLLM venv: .venv-vllm/bin/python -m benchmarks "
            f"--only {NAME}"
        ) from error
    if importlib.util.find_spec("pandas") is None:
        # vLLM's custom dataset reads its JSONL with pandas (vLLM's own "bench" extra).
        raise SystemExit(
            f"the {NAME} benchmark needs pandas in the vLLM venv, for vLLM's custom dataset: "
            ".venv-vllm/bin/python -m pip install pandas"
        )
    from benchmarks.vllm import build_model

    started = time.monotonic()
    trace, prompts, sizes = served_trace(workload)
    facts = {**trace_facts(trace, workload.primary_blocks, sizes["vllm_cache_blocks"]), **sizes}
    print(
        f"  {facts['requests']} requests, {facts['block_accesses']} block accesses, "
        f"{facts['distinct_blocks']} distinct blocks ({facts['working_set_over_primary']:.1f} "
        f"times the {workload.primary_blocks}-block pool); Belady "
        f"{facts['belady_primary_hit_rate']:.3f}",
        flush=True,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"kvwire-bench-{NAME}-", dir=output_dir))
    by_name = {config.name: config for config in configurations}
    try:
        model = build_model(scratch / "model", SHAPE)
        dataset = scratch / "trace.jsonl"
        write_dataset(dataset, prompts, workload.output_len)
        check_tokenizer(model, prompts)
        bench = Bench(model, workload, dataset, scratch, facts)

        # A BEST row's pick, kept for a round run in reverse, where it comes before its rows.
        picks: dict[str, tuple[str, str]] = {}

        def measure(name: str, _: int, earlier: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
            config = by_name[name]
            if config.eviction == BEST:
                picked = best_of(earlier) or picks.get(name)
                if picked is None:
                    return {
                        "kind": config.kind,
                        "status": "failed",
                        "reason": "no save_threshold 1 tiered row ran to pick the best of",
                    }
                picks[name] = picked
                config = attrs.evolve(config, eviction=picked[0], write_policy=picked[1])
            return bench.measure(config)

        try:
            rounds = interleaved(list(by_name), repeats, measure)
        finally:
            bench.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(workload, facts, rounds)
    summary["seconds"] = round(time.monotonic() - started)
    write_json(output_dir, f"{NAME}.json", summary)
    (output_dir / f"{NAME}.md").write_text(table(summary))
    plot(summary, output_dir / f"{NAME}.png")
    return headline(summary)


# ------------------------------------------------------------------ the report


def tier_counters(counters: Mapping[str, float], kind: str) -> dict[str, dict[str, float]]:
    """kvwire's counters of one server, by tier label (``{"CPU": {"bytes_saved": ...}}``)."""
    tiers_of_kind = TIER_PREFIXES.get(kind, ())
    prefixes = {prefix for known in TIER_PREFIXES.values() for _, prefix in known if prefix}
    grouped: dict[str, dict[str, float]] = {}
    for label, prefix in tiers_of_kind:
        found: dict[str, float] = {}
        for name, value in counters.items():
            counter = name.removeprefix("kvwire_")
            if counter == name or not counter.startswith(prefix):
                continue
            # The unprefixed tier takes what no other tier's prefix claims.
            if not prefix and any(counter.startswith(other) for other in prefixes):
                continue
            found[counter.removeprefix(prefix)] = value
        grouped[label] = found
    return grouped


def tier_hits(kind: str, by_tier: Mapping[str, Mapping[str, float]]) -> list[float]:
    """The blocks each tier gave the engine, the primary's first."""
    counts = list(by_tier.values())
    if kind == "tiered":
        primary, secondary = counts
        # Every block loaded passes through the pool: those the disk gave were
        # brought in first.
        from_secondary = secondary.get("promoted_blocks", 0)
        return [primary.get("blocks_loaded", 0) - from_secondary, from_secondary]
    if kind == "multi":
        # Each child counts the hits of its own lookups, though only one child loads them.
        return [tier.get("blocks_loaded", 0) for tier in counts]
    return [tier.get("lookup_hit_blocks", 0) for tier in counts]


def summarize(
    workload: Workload, facts: dict[str, Any], rounds: Sequence[Mapping[str, dict[str, Any]]]
) -> dict[str, Any]:
    """Each configuration's figures over the rounds, set against the limit's and Belady's.

    Every round's figures are kept (``rounds``); the ratios to the limit are
    each round's against that round's limit, given as their median and range;
    the figures that must not move between rounds (tokens, hits, bytes,
    outputs) are checked (:func:`benchmarks.rounds.agreed`).
    """
    per_round = [summarize_round(facts, rows) for rows in rounds]
    configurations = {
        name: over_rounds([entries[name] for entries in per_round]) for name in per_round[0]
    }
    # The prompts line up with vLLM's blocks, and its cache is modelled right, when these
    # measured counts equal the trace's.
    for fact, name, key in (
        ("limit_computed_tokens_measured", LIMIT, "computed_prompt_tokens"),
        ("prompt_tokens_measured", LIMIT, "prompt_tokens"),
        ("no_connector_computed_tokens_measured", NO_CONNECTOR, "computed_prompt_tokens"),
    ):
        measured = [entries[name][key] for entries in per_round if entries.get(name, {}).get(key)]
        if measured:
            facts[fact] = agreed(measured)
    return {
        "model": SHAPE,
        "block_size": BLOCK_SIZE,
        "kv_bytes_per_block": BLOCK_BYTES,
        "workload": attrs.asdict(workload),
        "primary_mib": pool_bytes(workload.primary_blocks) / MIB,
        "repeats": len(rounds),
        "trace": facts,
        "configurations": configurations,
    }


# Figures that move from round to round: their median and range over the rounds. The ratios
# to the round's limit and to its no-connector server, and the CPU seconds of kvwire's own
# threads.
SPREAD_KEYS = (
    "request_throughput_vs_limit",
    "output_throughput_vs_limit",
    "mean_ttft_vs_limit",
    "request_throughput_vs_no_connector",
    "kvwire_cpu_seconds",
)
# The client's own figures: their median and range over the rounds.
CLIENT_SPREAD_KEYS = ("request_throughput", "output_throughput", "mean_ttft_ms")
# Figures of the same trace on a fresh server that must be the same in every round.
AGREED_KEYS = (
    "computed_prompt_tokens",
    "loaded_tokens",
    "hit_blocks",
    "mib_written",
    "load_error_blocks",
    "outputs_equal_limit",
)


def over_rounds(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rounds in one entry: the first good round's counters, the ratios'
    median and range, the checks of what must agree, and every round as it was."""
    good = [entry for entry in entries if entry["status"] == "ok"]
    if not good:
        return {**entries[0], "rounds": list(entries)}
    combined = {
        **good[0],
        "failed_rounds": len(entries) - len(good),
        "rounds": list(entries),
    }
    for key in SPREAD_KEYS:
        combined[key] = spread([entry.get(key) for entry in good])
    # A pool must not cost more than it saves: the rounds it served faster than no connector
    # in the same round, a pairing the host's drift between rounds does not move.
    versus = [entry.get("request_throughput_vs_no_connector") for entry in good]
    combined["rounds_faster_than_no_connector"] = sum(
        value is not None and value > 1 for value in versus
    )
    combined["client_spread"] = {
        key: spread([entry["client"][key] for entry in good]) for key in CLIENT_SPREAD_KEYS
    }
    combined["checks"] = {
        key: agreed([entry[key] for entry in good]) for key in AGREED_KEYS if key in good[0]
    }
    return combined


def summarize_round(
    facts: Mapping[str, Any], rows: Mapping[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """One round's configurations, each set against that round's limit and Belady's."""
    limit = rows.get(LIMIT, {})
    limit_ok = limit.get("status") == "ok"
    none = rows.get(NO_CONNECTOR, {})
    none_ok = none.get("status") == "ok"
    configurations: dict[str, Any] = {}
    for name, row in rows.items():
        entry = {key: value for key, value in row.items() if key != "generated_texts"}
        configurations[name] = entry
        if row["status"] != "ok":
            continue
        figures = row["client"]
        server = row["server"]
        entry["client"] = {key: round(value, 3) for key, value in figures.items()}
        if limit_ok:
            theirs = limit["client"]
            entry["request_throughput_vs_limit"] = ratio(
                figures["request_throughput"], theirs["request_throughput"]
            )
            entry["output_throughput_vs_limit"] = ratio(
                figures["output_throughput"], theirs["output_throughput"]
            )
            entry["mean_ttft_vs_limit"] = ratio(figures["mean_ttft_ms"], theirs["mean_ttft_ms"])
            same = sum(
                ours == expected
                for ours, expected in zip(
                    row["generated_texts"], limit["generated_texts"], strict=True
                )
            )
            entry["outputs_equal_limit"] = f"{same}/{len(limit['generated_texts'])}"
        entry["request_throughput_vs_no_connector"] = (
            ratio(figures["request_throughput"], none["client"]["request_throughput"])
            if none_ok and name != NO_CONNECTOR
            else None
        )
        entry["computed_prompt_tokens"] = server.get("prompt_tokens_local_compute", 0)
        entry["prompt_tokens"] = server.get("prompt_tokens", 0)
        entry["vllm_cache_hit_tokens"] = server.get("prompt_tokens_local_cache_hit", 0)
        entry["loaded_tokens"] = server.get("prompt_tokens_external_kv_transfer", 0)
        by_tier = tier_counters(server, row["kind"])
        entry["tiers"] = by_tier
        entry["hit_blocks"] = dict(zip(by_tier, tier_hits(row["kind"], by_tier), strict=True))
        entry["mib_written"] = {
            label: round(tier.get("bytes_saved", 0) / MIB, 1) for label, tier in by_tier.items()
        }
        entry["load_error_blocks"] = sum(tier.get("load_errors", 0) for tier in by_tier.values())
        if row["kind"] in POOLED_KINDS:
            primary_hits = next(iter(entry["hit_blocks"].values()))
            entry["primary_hit_rate"] = primary_hits / facts["block_accesses"]
            entry["primary_of_belady"] = ratio(
                entry["primary_hit_rate"], facts["belady_primary_hit_rate"]
            )
            entry["primary_of_belady_behind_vllm"] = ratio(
                entry["primary_hit_rate"], facts["belady_primary_behind_vllm_hit_rate"]
            )
        # Blocks vLLM did not compute (its cache's and the connector's), over all asked for.
        entry["not_computed_rate"] = (
            1
            - (entry["computed_prompt_tokens"] - facts["requests"])
            / BLOCK_SIZE
            / facts["block_accesses"]
        )
    return configurations


def ratio(ours: float, theirs: float) -> float | None:
    return round(ours / theirs, 3) if theirs else None


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: throughput and TTFT over the limit's (median and range over the
    rounds), computed tokens, primary over Belady."""
    return {
        name: (
            {
                key: row.get(key)
                for key in (
                    "request_throughput_vs_limit",
                    "request_throughput_vs_no_connector",
                    "rounds_faster_than_no_connector",
                    "mean_ttft_vs_limit",
                    "computed_prompt_tokens",
                    "primary_hit_rate",
                    "primary_of_belady",
                    "failed_rounds",
                )
            }
            if row["status"] == "ok"
            else {"status": "failed"}
        )
        for name, row in summary["configurations"].items()
    }


def cell(value: Any, form: str) -> str:
    return "-" if value is None else format(value, form)


def table(summary: dict[str, Any]) -> str:
    """The README's table: one row a configuration, the median over the rounds and its range."""
    facts = summary["trace"]
    repeats = summary["repeats"]
    lines = [
        f"{facts['requests']} requests in the trace's order, one at a time; "
        f"{facts['block_accesses']} block accesses, {facts['distinct_blocks']} distinct blocks "
        f"of {summary['block_size']} tokens; vLLM's cache {facts['vllm_cache_blocks']} blocks, "
        f"every CPU pool {summary['workload']['primary_blocks']} blocks "
        f"({summary['primary_mib']:.0f} MiB). {rounds_label(repeats)} (every "
        "configuration once a round, the limit in each); req/s and TTFT are the median "
        "over the rounds (min-max), each ratio against its own round's limit; counts "
        "are the same in every round unless marked. Hit rates are over every block asked "
        f"for: Belady's at the pool's size {facts['belady_primary_hit_rate']:.3f} on every "
        f"block, {facts['belady_primary_behind_vllm_hit_rate']:.3f} on those vLLM's cache "
        f"misses; vLLM's cache alone {facts['vllm_cache_hit_rate']:.3f}; every reuse "
        f"{facts['reuse_hit_rate']:.3f}.",
        "",
        "| configuration | req/s | vs limit | vs no connector (rounds faster) "
        "| mean TTFT ms | vs limit "
        "| computed prompt tokens | loaded tokens | hit blocks: primary / tier 1 "
        "| primary hit rate | of Belady | of Belady behind vLLM's cache "
        "| MiB written: primary / tier 1 | kvwire threads' CPU s | load errors (blocks) "
        "| outputs = limit's | failed rounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["configurations"].items():
        if row["status"] != "ok":
            lines.append(f"| {name} | failed: {row.get('reason', '?')[:100]} |")
            continue
        checks = row["checks"]
        client = row["client_spread"]
        cells = [
            spread_cell(client["request_throughput"], ".2f"),
            spread_cell(row.get("request_throughput_vs_limit"), ".2f"),
            versus_no_connector(row),
            spread_cell(client["mean_ttft_ms"], ".0f"),
            spread_cell(row.get("mean_ttft_vs_limit"), ".2f"),
            agreed_cell(checks["computed_prompt_tokens"], ".0f"),
            agreed_cell(checks["loaded_tokens"], ".0f"),
            agreed_cell(tier_check(checks["hit_blocks"], ".0f")) or "-",
            cell(row.get("primary_hit_rate"), ".3f"),
            cell(row.get("primary_of_belady"), ".2f"),
            cell(row.get("primary_of_belady_behind_vllm"), ".2f"),
            agreed_cell(tier_check(checks["mib_written"], ".1f")) or "-",
            spread_cell(row.get("kvwire_cpu_seconds"), ".2f"),
            agreed_cell(checks["load_error_blocks"], ".0f"),
            agreed_cell(checks["outputs_equal_limit"]) if "outputs_equal_limit" in checks else "-",
            str(row["failed_rounds"]),
        ]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def versus_no_connector(row: Mapping[str, Any]) -> str:
    """``1.06 (0.95-1.17), 2 of 3``: req/s over no connector's, and the rounds it was faster."""
    figures = row.get("request_throughput_vs_no_connector")
    if figures is None:
        return "-"
    faster = row.get("rounds_faster_than_no_connector")
    return f"{spread_cell(figures, '.2f')}, {faster} of {figures['rounds']}"


def tier_check(check: Mapping[str, Any], form: str) -> dict[str, Any]:
    """A check of per-tier figures as one of ``primary / tier 1`` strings per round."""
    return {
        "same": check["same"],
        "rounds": [
            " / ".join(format(value, form) for value in by_tier.values())
            for by_tier in check["rounds"]
        ],
    }


def plot(summary: dict[str, Any], path: pathlib.Path) -> None:
    """Per configuration: computed prompt tokens, req/s over the limit's, the primary's hit rate."""
    plt = pyplot()
    rows = {name: row for name, row in summary["configurations"].items() if row["status"] == "ok"}
    names = list(rows)
    facts = summary["trace"]
    figure, panels = plt.subplots(1, 3, figsize=(15, 0.45 * len(names) + 1.8))
    # Each panel: the figure, its label and where its dotted lines go.
    series = (
        (
            "computed_prompt_tokens",
            "computed prompt tokens (dotted: the trace's distinct blocks)",
            [facts["limit_computed_tokens"]],
        ),
        (
            "request_throughput_vs_limit",
            "requests/s over the limit's (median of the rounds; line: their range)",
            [1.0],
        ),
        (
            "primary_hit_rate",
            "CPU pool's hit rate (dotted: Belady's, behind vLLM's cache / on every block)",
            [facts["belady_primary_hit_rate"], facts["belady_primary_behind_vllm_hit_rate"]],
        ),
    )
    for axes, (key, label, marks) in zip(panels, series, strict=True):
        for index, name in enumerate(names):
            value = rows[name].get(key)
            if isinstance(value, dict):  # a ratio over rounds: its median, its range drawn
                axes.plot([value["min"], value["max"]], [index, index], "k-", linewidth=1)
                value = value["median"]
            if value is None:
                continue
            tiered_row = rows[name]["kind"] == "tiered"
            axes.barh(index, value, color="#3f7fd9" if tiered_row else "#999999")
            shown = f"{value:.0f}" if key == "computed_prompt_tokens" else f"{value:.2f}"
            axes.text(value, index, f"  {shown}", va="center", fontsize=8)
        for mark in marks:
            axes.axvline(mark, color="k", linewidth=0.8, linestyle=":")
        axes.set_yticks(range(len(names)), names if axes is panels[0] else [""] * len(names))
        axes.invert_yaxis()
        axes.set_xlabel(label, fontsize=8)
    figure.suptitle(
        f"vllm serve (vLLM CPU, one core) under vllm bench serve: {facts['requests']} requests "
        f"in order, {facts['distinct_blocks']} distinct blocks of {summary['block_size']} "
        f"tokens; vLLM's cache {facts['vllm_cache_blocks']} blocks, every CPU pool "
        f"{summary['workload']['primary_blocks']} blocks",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
