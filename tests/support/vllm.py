"""vLLM for the tests: the tiny model, engines started and stopped, and what they run.

The prompts the tests send, generation with a deadline, the container hooks
the tests name in ``kvwire_container_hook``, and the kvwire connectors the
hybrid-model tests wrap.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import logging
import os
import pathlib
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import yaml
from dependency_injector import containers, providers

from kvwire.blocks.transfers import TransferPayload
from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.interface.base import KVConnectorBase, KVConnectorMetadata, SupportsHMA
from kvwire.interface.types import BlockHash, KVCacheEvent, Request, SchedulerOutput
from kvwire.media.base import LoadSpec, MediumIndex
from kvwire.media.cpu_pool import CPUPoolMedium
from kvwire.media.store.base import BlockStore
from kvwire.media.store.directory import DirectoryMedium
from kvwire.testing import IdleConnector
from kvwire.testing.faulty_medium import FaultInjectingMedium

# Building the tiny model, starting and stopping vLLM engines, and the prompts the tests send.

REPO = pathlib.Path(__file__).resolve().parents[2]
PROFILES = REPO / "src" / "kvwire" / "profiles"
BLOCK_SIZE = 32
MAX_TOKENS = 8
SLIDING_WINDOW = 64


def build_tiny_llama(directory: pathlib.Path, seed: int = 0, num_layers: int = 2) -> str:
    """Save a random-weight Llama (head_size 32: vLLM's CPU attention needs it) and a tokenizer.

    ``seed`` draws the weights: two seeds, two models of one shape.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    _save_word_tokenizer(directory)
    return str(directory)


def build_tiny_gemma3(directory: pathlib.Path) -> str:
    """Save a random-weight hybrid Gemma 3: layers 0 and 2 slide (window 64), 1 and 3 are full.

    With the hybrid KV cache manager on, vLLM gives it two KV cache groups
    (``SlidingWindowSpec(64)`` and ``FullAttentionSpec``); the tokenizer is
    the Llama's.
    """
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_hidden_layers=4,
        max_position_embeddings=4096,
    )
    Gemma3ForCausalLM(config).save_pretrained(directory)
    _save_word_tokenizer(directory)
    return str(directory)


def _save_word_tokenizer(directory: pathlib.Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(1024)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(directory)


def shared_prompts(count: int = 3, length: int = 300) -> list[dict[str, list[int]]]:
    """Prompts of ``length`` tokens, each its own: 9 full blocks of 32 are loadable per prompt."""
    return [
        {"prompt_token_ids": [(index * 7 + position) % 1000 + 3 for position in range(length)]}
        for index in range(count)
    ]


def counters(
    stats: Mapping[str, int | float], name: str, *, tiers: bool = False
) -> list[int | float]:
    """Every connector's value of counter ``name``: one per child of a MultiConnector, one for
    any other connector.

    A tiered connector's ``tier<N>.`` counters say again, tier by tier, what its
    own count (a block promoted from its disk counts in ``blocks_loaded`` and in
    ``tier1.blocks_loaded``): left out, but with ``tiers``.
    """
    values = []
    for key, value in stats.items():
        *scope, counter = key.split(".")
        if counter == name and (tiers or not (scope and re.fullmatch(r"tier\d+", scope[-1]))):
            values.append(value)
    return values


def with_redis_url(profile: dict[str, Any], url: str, key_prefix: str) -> dict[str, Any]:
    """``profile`` with every Redis connector pointed at ``url`` under ``key_prefix``."""
    for config in _option_mappings(profile):
        if "url" in config:
            config["url"] = url
            config["key_prefix"] = key_prefix
    return profile


def with_small_pools(profile: dict[str, Any], size: str = "64MiB") -> dict[str, Any]:
    """``profile`` with every CPU pool it sizes (a tier's too) at ``size``.

    The shipped pools are sized for production; the tests' prompts need little.
    """
    for config in _option_mappings(profile):
        if "cpu_pool_bytes" in config:
            config["cpu_pool_bytes"] = size
    return profile


def create_engine_config(model: str, kv_transfer_config: dict[str, Any]) -> Any:
    """vLLM's configuration of the tiny model with ``kv_transfer_config``, as vLLM builds it
    (kvwire's plugin checks a kvwire profile there)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        enforce_eager=True,
        kv_transfer_config=kv_transfer_config,
    ).create_engine_config()


def kvwire_transfer_config(
    profile: str | Mapping[str, Any], kv_role: str = "kv_both", **extra: Any
) -> dict[str, Any]:
    """vLLM's kv_transfer_config for KVWireConnector: a profile name or path, or a mapping given
    inline."""
    key = "kvwire_profile" if isinstance(profile, str) else "kvwire"
    return {
        "kv_connector": "KVWireConnector",
        "kv_connector_module_path": "kvwire.vllm",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {key: profile, **extra},
    }


def load_profile_mapping(name: str) -> dict[str, Any]:
    profile: dict[str, Any] = yaml.safe_load((PROFILES / name).read_text())
    return profile


def profile_with_directory(name: str, directory: pathlib.Path) -> dict[str, Any]:
    """A shipped profile, its storage directories moved under ``directory``."""
    profile: dict[str, Any] = yaml.safe_load((PROFILES / name).read_text())
    for index, config in enumerate(_option_mappings(profile)):
        if "shared_storage_path" in config:
            config["shared_storage_path"] = str(directory / f"store-{index}")
    return profile


def _option_mappings(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """The profile's connector options, each child's and each tier's too (to edit in place)."""
    extra: dict[str, Any] = profile["kv_transfer_config"]["kv_connector_extra_config"]
    children = [child["kv_connector_extra_config"] for child in extra.get("connectors", [])]
    return [extra, *children, *extra.get("tiers", [])]


def run_engine_process(
    model: str,
    kv_transfer_config: Mapping[str, Any],
    prompts: Sequence[Mapping[str, Any]],
    max_tokens: int,
    workdir: pathlib.Path,
    env: Mapping[str, str] | None = None,
    passes: int = 1,
    engine_args: Mapping[str, Any] | None = None,
    prompt_passes: Sequence[Sequence[Mapping[str, Any]]] = (),
    timeout_s: float = 300,
) -> dict[str, Any]:
    """Run one engine in a process of its own (tests/support/processes/vllm_engine.py).

    Returns its result. ``prompt_passes``, when given, replaces ``passes`` passes over
    ``prompts``.
    """
    name = f"engine-{len(list(workdir.glob('engine-*.json')))}"
    job = workdir / f"{name}.json"
    output = workdir / f"{name}-output.json"
    job.write_text(
        json.dumps(
            {
                "model": model,
                "kv_transfer_config": dict(kv_transfer_config),
                "prompts": list(prompts),
                "max_tokens": max_tokens,
                "passes": passes,
                "engine_args": dict(engine_args or {}),
                "prompt_passes": [list(prompts) for prompts in prompt_passes],
                "output": str(output),
            }
        )
    )
    completed = subprocess.run(
        [sys.executable, "-m", "tests.support.processes.vllm_engine", str(job)],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if completed.returncode != 0:
        raise AssertionError(f"engine process failed:\n{completed.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(output.read_text())
    return result


@contextlib.contextmanager
def prefill_process(
    model: str,
    kv_transfer_config: Mapping[str, Any],
    prompts: Sequence[Mapping[str, Any]],
    workdir: pathlib.Path,
    kv_transfer_params: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """A vLLM engine in a process of its own that prefilled ``prompts`` (one token each) and
    stays up, its memory readable by decode engines, until the block exits.

    Yields the engine process's result (tests/support/processes/vllm_engine.py), once prefilled.
    """
    job, output, release = (workdir / name for name in ("job.json", "out.json", "release"))
    job.write_text(
        json.dumps(
            {
                "model": model,
                "kv_transfer_config": dict(kv_transfer_config),
                "kv_transfer_params": dict(kv_transfer_params or {}),
                "prompts": list(prompts),
                "max_tokens": 1,
                "passes": 1,
                "output": str(output),
                "hold_until": str(release),
                "hold_s": 300,
            }
        )
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.processes.vllm_engine", str(job)],
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    try:
        deadline = time.monotonic() + 300
        while not output.exists():
            assert process.poll() is None, f"the prefill process ended ({process.returncode})"
            assert time.monotonic() < deadline, "the prefill process never finished prefilling"
            time.sleep(0.1)
        yield json.loads(output.read_text())
    finally:
        release.touch()
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def start_llm(
    model: str, kv_transfer_config: Mapping[str, Any] | None = None, **engine_args: Any
) -> Any:
    from vllm import LLM

    from kvwire.vllm import WORKER_EXTENSION

    return LLM(
        model,
        **{
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
            "max_model_len": 2048,
            "enable_prefix_caching": True,
            "enforce_eager": True,
            "distributed_executor_backend": "uni",
            "seed": 0,
            "kv_transfer_config": dict(kv_transfer_config) if kv_transfer_config else None,
            "worker_extension_cls": WORKER_EXTENSION,
            **engine_args,
        },
    )


def stop_llm(llm: Any) -> None:
    """Shut the engine down (the connector's shutdown included) so the next one starts clean."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


@contextlib.contextmanager
def running_llm(
    model: str, kv_transfer_config: Mapping[str, Any] | None = None, **engine_args: Any
) -> Iterator[Any]:
    llm = start_llm(model, kv_transfer_config, **engine_args)
    try:
        yield llm
    finally:
        stop_llm(llm)


def generate(
    llm: Any, prompts: Sequence[Mapping[str, Any]], max_tokens: int = MAX_TOKENS
) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of each prompt, and how many prompt tokens vLLM did not compute."""
    from vllm import SamplingParams

    outputs = llm.generate(
        list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False
    )
    return (
        [list(output.outputs[0].token_ids) for output in outputs],
        [output.num_cached_tokens for output in outputs],
    )


# Generating in a vLLM engine by stepping it, with a deadline: an engine that stops finishing
# requests fails the test that asked, with what its scheduler holds, instead of hanging it.


def generate_within(
    llm: Any,
    prompts: Sequence[Mapping[str, Any]],
    limit_s: float,
    max_tokens: int = MAX_TOKENS,
) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of each prompt and their cached prompt tokens, as ``generate`` returns them.

    Fails (``AssertionError``) when the engine has not finished every request
    ``limit_s`` seconds after they were added, naming how many requests
    wait in each state: those requests are aborted first, so the engine
    can serve the next test.
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    request_ids = [f"bounded-{time.monotonic_ns()}-{index}" for index in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(request_id, dict(prompt), params)
    finished: dict[str, Any] = {}
    deadline = time.monotonic() + limit_s
    steps = 0
    while len(finished) < len(request_ids):
        if time.monotonic() > deadline:
            states = _scheduler_states(engine)
            engine.abort_request([r for r in request_ids if r not in finished])
            _drain(engine, deadline=time.monotonic() + 60)
            raise AssertionError(
                f"{len(request_ids) - len(finished)} of {len(request_ids)} requests not finished "
                f"after {limit_s:g} s ({steps} engine steps); the scheduler held: {states}"
            )
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        steps += 1
    outputs = [finished[request_id] for request_id in request_ids]
    return (
        [list(output.outputs[0].token_ids) for output in outputs],
        [output.num_cached_tokens for output in outputs],
    )


def _scheduler_states(engine: Any) -> dict[str, int]:
    scheduler = engine.engine_core.engine_core.scheduler
    return dict(collections.Counter(r.status.name for r in scheduler.requests.values()))


def _drain(engine: Any, deadline: float) -> None:
    """Step until the aborted requests are gone (their loads end by their own deadline)."""
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()


class _Counting(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__(logging.WARNING)
        self.needle = needle
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.count += 1


@contextmanager
def counting_recoveries() -> Iterator[_Counting]:
    """Counts vLLM's "Recovered from KV load failure" warnings while the block runs."""
    handler = _Counting("Recovered from KV load failure")
    scheduler_logger = logging.getLogger("vllm.v1.core.sched.scheduler")
    scheduler_logger.addHandler(handler)
    try:
        yield handler
    finally:
        scheduler_logger.removeHandler(handler)


# Container hooks the tests name in ``kvwire_container_hook``: they override providers of the
# container KVWireConnector builds inside vLLM, as a deployment would.


class NeverHitIndex(MediumIndex):
    """``index``, except that it never reports a block as held: every lookup misses."""

    def __init__(self, index: MediumIndex) -> None:
        self._index = index

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        return 0

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> LoadSpec:
        return self._index.prepare_load(group, block_hashes)

    def complete_load(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        corrupt: Sequence[BlockHash],
        payload: TransferPayload | None = None,
    ) -> None:
        self._index.complete_load(group, block_hashes, corrupt, payload=payload)

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        return self._index.prepare_save(group, block_hashes)

    def complete_save(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        self._index.complete_save(group, block_hashes, success=success)

    def take_events(self) -> list[KVCacheEvent]:
        return self._index.take_events()

    def take_counters(self) -> Mapping[str, int]:
        return self._index.take_counters()

    def reset(self) -> bool | None:
        return self._index.reset()

    def close(self) -> None:
        self._index.close()


class NeverHitPool(CPUPoolMedium):
    """The CPU pool, its blocks stored as ever, but never found by a lookup."""

    def build_index(self) -> MediumIndex:
        return NeverHitIndex(super().build_index())


class NeverHitCPUOffload(CPUOffloadConnector):
    """CPU offload whose pool never reports a block as held: every lookup misses.

    The medium is named by module path, so the scheduler's process resolves it too.
    """

    default_medium = f"{__name__}:{NeverHitPool.__name__}"


def never_hit(container: containers.Container) -> None:
    container.connector_class.override(providers.Object(NeverHitCPUOffload))


READS_ANSWER = threading.Event()
"""While clear, every read of :class:`HeldReadsSharedStorage`'s store waits for it (bounded)."""
READS_ANSWER.set()

HELD_READ_LIMIT_S = 60.0
"""No read is held longer than this, whatever a failed test left behind."""


class HeldReadsStore(BlockStore):
    """``store``, whose reads wait for :data:`READS_ANSWER`: a load stays in flight meanwhile."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store
        self.medium = store.medium

    def count_prefix(self, keys: Sequence[str]) -> int:
        return self._store.count_prefix(keys)

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        return self._store.put(keys, entries)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        READS_ANSWER.wait(HELD_READ_LIMIT_S)
        return self._store.get_into(keys, buffers)

    def discard(self, keys: Sequence[str]) -> None:
        self._store.discard(keys)

    def take_removed_keys(self) -> list[str]:
        return self._store.take_removed_keys()

    def close(self) -> None:
        self._store.close()


class HeldReadsDirectory(DirectoryMedium):
    """The directory medium over a :class:`HeldReadsStore`."""

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        return HeldReadsStore(super().create_store(options))


class HeldReadsSharedStorage(SharedStorageConnector):
    """Shared storage whose loads stay in flight until a test sets :data:`READS_ANSWER`."""

    default_medium = f"{__name__}:{HeldReadsDirectory.__name__}"


def held_reads(container: containers.Container) -> None:
    container.connector_class.override(providers.Object(HeldReadsSharedStorage))


# Loads that end in any order: each read of the store waits 0-80 ms, drawn at random.

MAX_READ_DELAY_S = 0.08


class DelayedReadsStore(HeldReadsStore):
    """``store``, whose every read first waits a random 0-80 ms (and for READS_ANSWER)."""

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        time.sleep(random.uniform(0.0, MAX_READ_DELAY_S))
        return super().get_into(keys, buffers)


class DelayedReadsDirectory(DirectoryMedium):
    """The directory medium over a :class:`DelayedReadsStore`."""

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        return DelayedReadsStore(super().create_store(options))


class FailEveryFirstBlockOfDelayedLoads(FaultInjectingMedium):
    """Every request's first load fails at its first block; every read waits 0-80 ms."""

    inner = DelayedReadsDirectory
    fail_block_index = 0


# kvwire connectors the hybrid-model tests wrap: one without HMA, one with, both recording.
#
# A profile names them by ``kv_connector`` and ``kv_connector_module_path``
# (``tests.support.vllm``), as a third-party connector is named.
# They hold no KV: every lookup misses and nothing is saved.

MODULE = __name__


class PlainConnector(IdleConnector):
    """A connector without HMA that holds no KV, recording what it is handed.

    ``finished``: each ``request_finished`` call; ``scheduled``: each
    request's block ids in the last step that scheduled it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished: list[tuple[str, Any]] = []
        self.scheduled: dict[str, tuple[list[int], ...]] = {}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for item in scheduler_output.scheduled:
            self.scheduled[item.request_id] = item.block_ids
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(("request_finished", list(block_ids)))
        return False, None


class GroupsConnector(PlainConnector, SupportsHMA):
    """``PlainConnector`` with HMA: ``finished`` records each group's block ids."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(("request_finished_all_groups", tuple(block_ids)))
        return False, None


def wrapping_profile(connector: type[KVConnectorBase]) -> dict[str, Any]:
    """An inline kvwire profile wrapping ``connector`` (vLLM supplies the engine's facts)."""
    return {
        "kv_transfer_config": {
            "kv_connector": connector.__name__,
            "kv_connector_module_path": MODULE,
            "kv_role": "kv_both",
        }
    }
