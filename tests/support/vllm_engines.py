"""Building the tiny model, starting and stopping vLLM engines, and the prompts the tests send."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import yaml

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


def with_redis_url(profile: dict[str, Any], url: str, key_prefix: str) -> dict[str, Any]:
    """``profile`` with every Redis connector pointed at ``url`` under ``key_prefix``."""
    extra = profile["kv_transfer_config"]["kv_connector_extra_config"]
    for config in [extra, *(c["kv_connector_extra_config"] for c in extra.get("connectors", []))]:
        if "url" in config:
            config["url"] = url
            config["key_prefix"] = key_prefix
    return profile


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
    extra = profile["kv_transfer_config"]["kv_connector_extra_config"]
    configs = [child["kv_connector_extra_config"] for child in extra.get("connectors", [])]
    for index, config in enumerate([extra, *configs]):
        if "shared_storage_path" in config:
            config["shared_storage_path"] = str(directory / f"store-{index}")
    return profile


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
    """Run one engine in a new process (tests/support/vllm_engine_process.py) and return its result.

    ``prompt_passes``, when given, replaces ``passes`` passes over ``prompts``.
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
        [sys.executable, "-m", "tests.support.vllm_engine_process", str(job)],
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

    Yields the engine process's result (tests/support/vllm_engine_process.py), once prefilled.
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
        [sys.executable, "-m", "tests.support.vllm_engine_process", str(job)],
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
