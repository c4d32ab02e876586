"""Time to first token of a warm pass inside vLLM: no connector, vLLM's ExampleConnector,
kvwire's CPU offload and shared storage.

``.venv-vllm/bin/python -m benchmarks --only vllm`` (the vLLM venv: ``make
.venv-vllm/.kvwire-installed``). One vLLM 0.32 CPU engine per configuration,
each in a process of its own, on the same random-weight Llama, large enough
that prefill dominates. Each engine generates one token for every prompt (the
cold pass, which fills the connector), waits for the connector's saves,
empties vLLM's prefix cache and generates again (the warm pass): the warm
pass's prompts are computed again (no connector) or loaded from the
connector. A prompt's time to first token is the wall time of a one-token
``generate()`` of that prompt alone; the table gives the p50 over the
prompts, and every configuration's warm tokens are checked against no
connector's. A connector's warm pass is run 3 times (its prefix cache emptied
before each), so that a burst of other load on a shared machine moves its p50
less.

Two models: a GQA one (2 KV heads, 8 KiB of KV per token) and an MHA one
(KV heads = attention heads as in Llama-2-7B, twice the layers: 64 KiB per
token, 8 times the KV to load for the same prompt). A row "vLLM prefix
cache" is the no-connector engine's last passes (3), with its prefix cache kept:
nothing is loaded, only the prompt's last block is computed again, which
every connector's warm pass must compute too: the floor no connector can
go below. ``load_wait_ms_p50`` is the time the engine's thread spent in the
connector's ``start_load_kv`` and ``wait_for_layer_load`` (the load as the
forward pass sees it).

The GQA model also runs at tensor parallelism 2 (vLLM's multiprocessing
executor, each rank bound to a core of its own by
``VLLM_CPU_OMP_THREADS_BIND="0|1"``), against stores of one KV head per
entry (``entry_kv_heads: 1``, what lets sizes share entries): a TP=1
engine writes the prompts' entries (and gives its own warm pass, the TP=1
bound), then one TP=2 engine loads them (the cross-size load, every rank
reading its head of entries written by one rank), computes other prompts of
the same shape, saves them and loads them back (the same-size load); a TP=2
engine without a connector computes those other prompts warm (the TP=2
bound). At TP=2 the load wait is not measured: the ranks' connectors live in
the worker processes.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import pyplot, write_json

CONFIGURATIONS = (
    "no connector",
    "vLLM ExampleConnector",
    "kvwire CPU offload",
    "kvwire shared storage",
)
FLOOR = "vLLM prefix cache"
WARM_ROUNDS = 3
BLOCK_SIZE = 32
VOCAB = 4096
BYTES_PER_VALUE = 4  # float32
# Prefill of a 2k-token prompt takes about a second on two cores: it dominates the TTFT.
GQA_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
# KV heads = attention heads, as in Llama-2-7B, and twice the layers.
MHA_SHAPE = GQA_SHAPE | {"num_hidden_layers": 16, "num_key_value_heads": 8}
MODELS = {"GQA, 8 layers": GQA_SHAPE, "MHA, 16 layers": MHA_SHAPE}
PARALLEL_MODEL = "GQA, 8 layers"
TP2_ENGINE_ARGS = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# vLLM refuses TP=2 on a CPU unless each rank is given a core of its own.
TP2_ENVIRONMENT = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def kv_bytes_per_token(shape: dict[str, int]) -> int:
    head_size = shape["hidden_size"] // shape["num_attention_heads"]
    return (
        2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_size * BYTES_PER_VALUE
    )


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            "the vllm benchmark runs in the vLLM venv: .venv-vllm/bin/python -m benchmarks "
            "--only vllm"
        ) from error
    prompt_tokens = 1024 if quick else 2048
    num_prompts = 3 if quick else 5
    prompts = [
        [(index * 7919 + position * 31) % (VOCAB - 3) + 3 for position in range(prompt_tokens)]
        for index in range(num_prompts)
    ]
    # Prompts of the same shape that no TP=1 engine stores: the TP=2 engines' same-size pass.
    other_prompts = [
        [(index * 7919 + position * 37 + 1) % (VOCAB - 3) + 3 for position in range(prompt_tokens)]
        for index in range(num_prompts)
    ]
    summary: dict[str, Any] = {"prompt_tokens": prompt_tokens, "prompts": num_prompts, "models": {}}
    for model_name, full_shape in MODELS.items():
        shape = full_shape | ({"num_hidden_layers": 4} if quick else {})
        print(f"  {model_name}", flush=True)
        with tempfile.TemporaryDirectory(prefix="kvwire-vllm-bench-") as scratch:
            root = pathlib.Path(scratch)
            model = build_model(root / "model", shape)
            prompt_kv_bytes = kv_bytes_per_token(shape) * prompt_tokens
            results: dict[str, dict[str, Any]] = {}
            for name in CONFIGURATIONS:
                results[name] = run_engine_process(
                    name, model, prompts, root, prompt_kv_bytes * num_prompts, prompt_kv_bytes
                )
                if name == "no connector" and model_name == PARALLEL_MODEL:
                    summary["tensor_parallel"] = run_tensor_parallel(
                        model, prompts, other_prompts, root, prompt_kv_bytes, results[name]
                    )
        summary["models"][model_name] = summarize(shape, prompt_tokens, results)
    write_json(output_dir, "vllm.json", summary)
    plot(summary, output_dir / "vllm.png")
    return summary


def run_tensor_parallel(
    model: str,
    prompts: list[list[int]],
    other_prompts: list[list[int]],
    scratch: pathlib.Path,
    prompt_kv_bytes: int,
    tp1_no_connector: dict[str, Any],
) -> dict[str, Any]:
    """The TP=2 rows (see the module): three engines, one store of one KV head per entry."""
    kv_bytes = prompt_kv_bytes * len(prompts)
    store = scratch / "kvwire-per-head-store"
    per_head = {"entry_kv_heads": 1, "shared_storage_path": str(store)}
    tp1 = run_engine_process(
        "TP=1 kvwire shared storage, one head per entry",
        model,
        prompts,
        scratch,
        kv_bytes,
        prompt_kv_bytes,
        options=per_head,
    )
    tp2_bound = run_engine_process(
        "TP=2 no connector",
        model,
        other_prompts,
        scratch,
        kv_bytes,
        prompt_kv_bytes,
        engine_args=TP2_ENGINE_ARGS,
        environment=TP2_ENVIRONMENT,
    )
    tp2 = run_engine_process(
        "TP=2 kvwire shared storage, one head per entry",
        model,
        other_prompts,
        scratch,
        kv_bytes,
        prompt_kv_bytes,
        options=per_head,
        engine_args=TP2_ENGINE_ARGS,
        environment=TP2_ENVIRONMENT,
        stored_prompts=prompts,
    )
    return summarize_tensor_parallel(tp1_no_connector, tp1, tp2_bound, tp2)


def summarize_tensor_parallel(
    tp1_no_connector: dict[str, Any],
    tp1: dict[str, Any],
    tp2_bound: dict[str, Any],
    tp2: dict[str, Any],
) -> dict[str, Any]:
    """The TP=2 table: each engine's warm p50, and the ratios the README and docs quote."""
    p50 = statistics.median
    rows = {
        "TP=1 no connector": p50(tp1_no_connector["warm_seconds"]),
        "TP=1 kvwire, written and loaded at TP=1": p50(tp1["warm_seconds"]),
        "TP=2 no connector": p50(tp2_bound["warm_seconds"]),
        "TP=2 kvwire, written and loaded at TP=2": p50(tp2["warm_seconds"]),
        "TP=2 kvwire, written at TP=1, loaded at TP=2": p50(tp2["stored_seconds"]),
    }
    same_size = rows["TP=2 kvwire, written and loaded at TP=2"]
    cross_size = rows["TP=2 kvwire, written at TP=1, loaded at TP=2"]
    return {
        "warm_ttft_p50_s": rows,
        "tp2_warm_vs_tp2_no_connector": same_size / rows["TP=2 no connector"],
        "tp2_warm_vs_tp1_warm": same_size / rows["TP=1 kvwire, written and loaded at TP=1"],
        "tp2_no_connector_vs_tp1_no_connector": rows["TP=2 no connector"]
        / rows["TP=1 no connector"],
        "cross_size_vs_same_size": cross_size / same_size,
        "cross_size_vs_tp2_no_connector": cross_size / rows["TP=2 no connector"],
        # TP=2 tokens are TP=1's: the cross-size pass is checked against TP=1 on its prompts.
        "tp2_warm_tokens_equal_tp2_no_connector": same_tokens(
            tp2["warm_tokens"], tp2_bound["warm_tokens"]
        ),
        "cross_size_tokens_equal_tp1_no_connector": same_tokens(
            tp2["stored_tokens"], tp1_no_connector["warm_tokens"]
        ),
        "tp1_warm_tokens_equal_tp1_no_connector": same_tokens(
            tp1["warm_tokens"], tp1_no_connector["warm_tokens"]
        ),
        "cached_tokens": {
            "TP=1 warm": sorted(set(tp1["warm_cached"])),
            "TP=2 warm": sorted(set(tp2["warm_cached"])),
            "TP=2 cross-size": sorted(set(tp2["stored_cached"])),
        },
        "kvwire_stats_tp2": {
            name: tp2["kvwire_stats"].get(name, 0)
            for name in ("blocks_loaded", "load_errors", "saves_dropped")
        },
    }


def same_tokens(rounds: list[list[int]], expected: list[list[int]]) -> bool:
    """Whether every round of a pass gave, prompt by prompt, the ``expected`` tokens."""
    return len(rounds) % len(expected) == 0 and all(
        tokens == expected[index % len(expected)] for index, tokens in enumerate(rounds)
    )


def summarize(
    shape: dict[str, int], prompt_tokens: int, results: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One model's table: each configuration's p50s, and its warm pass against the others."""
    baseline = results["no connector"]
    expected = baseline["warm_tokens"]
    configurations: dict[str, Any] = {}
    for name, result in results.items():
        configurations[name] = {
            "cold_ttft_p50_s": statistics.median(result["cold_seconds"]),
            "warm_ttft_p50_s": statistics.median(result["warm_seconds"]),
            "load_wait_ms_p50": statistics.median(result["load_wait_seconds"]) * 1000,
            "warm_cached_tokens": sorted(set(result["warm_cached"])),
            "warm_tokens_equal_no_connector": same_tokens(result["warm_tokens"], expected),
            "kvwire_blocks_loaded": result["kvwire_stats"].get("blocks_loaded", 0),
            "kvwire_load_errors": result["kvwire_stats"].get("load_errors", 0),
            "kvwire_saves_dropped": result["kvwire_stats"].get("saves_dropped", 0),
        }
    configurations[FLOOR] = {
        "warm_ttft_p50_s": statistics.median(baseline["floor_seconds"]),
        "warm_cached_tokens": sorted(set(baseline["floor_cached"])),
        "warm_tokens_equal_no_connector": same_tokens(baseline["floor_tokens"], expected),
    }
    no_connector = configurations["no connector"]["warm_ttft_p50_s"]
    example = configurations["vLLM ExampleConnector"]["warm_ttft_p50_s"]
    for entry in configurations.values():
        entry["warm_vs_no_connector"] = entry["warm_ttft_p50_s"] / no_connector
        entry["warm_vs_example_connector"] = entry["warm_ttft_p50_s"] / example
    return {
        "model": shape,
        "kv_bytes_per_token": kv_bytes_per_token(shape),
        "kv_mib_per_prompt": kv_bytes_per_token(shape) * prompt_tokens / 2**20,
        "configurations": configurations,
    }


def build_model(directory: pathlib.Path, shape: dict[str, int]) -> str:
    """A random-weight Llama and a word-level tokenizer, saved for vLLM (no hub)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **shape)).save_pretrained(directory)
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(directory)
    return str(directory)


def transfer_config(
    name: str,
    scratch: pathlib.Path,
    kv_bytes: int,
    save_bytes: int,
    options: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """vLLM's kv_transfer_config for a configuration.

    kvwire's profiles are sized for the tiny model of ``kvwire run``: the CPU
    pool is set to hold every prompt's KV (``kv_bytes``, a quarter more for
    headers and rounding), the shared storage's staging buffers to two
    prompts' (``save_bytes`` each), so that no save is dropped for room.
    ``options`` are set on the kvwire connector over the preset's.
    """
    if name.endswith("no connector"):
        return None
    if name == "vLLM ExampleConnector":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"shared_storage_path": str(scratch / "example")},
        }
    import yaml

    from kvwire.config.profile import shipped_profile_path

    mib = 2**20
    if "CPU offload" in name:
        mapping = yaml.safe_load(shipped_profile_path("cpu-offload").read_text())
        preset = mapping["kv_transfer_config"]["kv_connector_extra_config"]
        preset["cpu_pool_bytes"] = f"{-(-kv_bytes * 5 // 4 // mib)}MiB"
    else:
        mapping = yaml.safe_load(shipped_profile_path("shared-storage").read_text())
        preset = mapping["kv_transfer_config"]["kv_connector_extra_config"]
        preset["shared_storage_path"] = str(scratch / "kvwire-shared-storage")
        preset["max_save_bytes_in_flight"] = f"{-(-save_bytes * 2 // mib)}MiB"
    mapping["kv_transfer_config"]["kv_connector_extra_config"].update(options or {})
    extra = {"kvwire": mapping}
    return {
        "kv_connector": "KVWireConnector",
        "kv_connector_module_path": "kvwire.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def run_engine_process(
    name: str,
    model: str,
    prompts: list[list[int]],
    scratch: pathlib.Path,
    kv_bytes: int,
    save_bytes: int,
    options: dict[str, Any] | None = None,
    engine_args: dict[str, Any] | None = None,
    environment: dict[str, str] | None = None,
    stored_prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Run one configuration's engine in a new process; its measurements.

    ``stored_prompts``, prompts an earlier engine stored, are loaded first
    (``WARM_ROUNDS`` times, the prefix cache emptied before each).
    """
    job = scratch / f"{name.replace(' ', '-').replace(',', '')}.json"
    job.write_text(
        json.dumps(
            {
                "model": model,
                "prompts": prompts,
                "stored_prompts": stored_prompts or [],
                "engine_args": engine_args or {},
                "kv_transfer_config": transfer_config(name, scratch, kv_bytes, save_bytes, options),
                "output": str(job.with_suffix(".out")),
            }
        )
    )
    print(f"    {name} ...", flush=True)
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.vllm", "--engine", str(job)],
        env={**engine_environment(scratch), **(environment or {})},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"{name}: the engine process failed:\n{completed.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(job.with_suffix(".out").read_text())
    return result


def start_llm(model: str, kv_transfer_config: dict[str, Any] | None, **engine_args: Any) -> Any:
    """The benchmarks' vLLM engine: float32, eager, prefix caching on, in this process
    (``engine_args`` over these: a TP=2 engine's ranks run in processes of their own)."""
    from vllm import LLM

    from kvwire.vllm import WORKER_EXTENSION

    return LLM(
        model,
        **{
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
            "max_model_len": 4096,
            "enable_prefix_caching": True,
            "enforce_eager": True,
            "distributed_executor_backend": "uni",
            "seed": 0,
            "kv_transfer_config": kv_transfer_config,
            "worker_extension_cls": WORKER_EXTENSION,
            **engine_args,
        },
    )


def engine_environment(scratch: pathlib.Path) -> dict[str, str]:
    """An engine process's environment: its core in that process, offline, a 2 GiB KV cache."""
    return {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
    }


def measure_engine(job_path: str) -> None:
    """The engine process: cold pass, saves settled, prefix cache emptied, warm pass.

    Without a connector, a third pass keeps the prefix cache: the floor.
    """
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from kvwire.vllm import kvwire_stats, wait_for_saves

    job = json.loads(pathlib.Path(job_path).read_text())
    config = job["kv_transfer_config"]
    llm = start_llm(job["model"], config, **job["engine_args"])
    one_token = SamplingParams(max_tokens=1, temperature=0)
    load_wait = [0.0]
    if has_kv_transfer_group() and not job["engine_args"]:
        # In-process engine (no multiprocessing): this is the worker's connector.
        time_loads(get_kv_transfer_group(), load_wait)

    def timed_pass(prompts: list[list[int]] = job["prompts"]) -> dict[str, list[Any]]:
        measured: dict[str, list[Any]] = {"seconds": [], "tokens": [], "cached": [], "wait": []}
        for prompt in prompts:
            load_wait[0] = 0.0
            started = time.perf_counter()
            (output,) = llm.generate([{"prompt_token_ids": prompt}], one_token, use_tqdm=False)
            measured["seconds"].append(time.perf_counter() - started)
            measured["tokens"].append(list(output.outputs[0].token_ids))
            measured["cached"].append(output.num_cached_tokens)
            measured["wait"].append(load_wait[0])
        return measured

    llm.generate([{"prompt_token_ids": [5] * 64}], one_token, use_tqdm=False)  # warm-up
    uses_kvwire = config is not None and config["kv_connector"] == "KVWireConnector"
    stored: dict[str, list[Any]] = {}
    for _ in range(WARM_ROUNDS if job["stored_prompts"] else 0):
        if uses_kvwire:
            wait_for_saves(llm)  # a save still held (the warm-up's) keeps the cache from emptying
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not empty its prefix cache")
        for key, values in timed_pass(job["stored_prompts"]).items():
            stored.setdefault(key, []).extend(values)
    cold = timed_pass()
    if uses_kvwire:
        wait_for_saves(llm)
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not empty its prefix cache")
    warm = timed_pass()
    # A connector's warm pass is short: repeated (see the module).
    for _ in range(0 if config is None else WARM_ROUNDS - 1):
        if uses_kvwire:
            wait_for_saves(llm)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not empty its prefix cache")
        for key, values in timed_pass().items():
            warm[key] += values
    floor: dict[str, list[Any]] = {}
    for _ in range(WARM_ROUNDS if config is None else 0):
        for key, values in timed_pass().items():
            floor.setdefault(key, []).extend(values)
    # vLLM counts a failed load as cached too: kvwire's own counters tell.
    stats = kvwire_stats(llm) if uses_kvwire else {}
    pathlib.Path(job["output"]).write_text(
        json.dumps(
            {
                "cold_seconds": cold["seconds"],
                "warm_seconds": warm["seconds"],
                "warm_tokens": warm["tokens"],
                "warm_cached": warm["cached"],
                "load_wait_seconds": warm["wait"],
                "floor_seconds": floor.get("seconds", []),
                "floor_tokens": floor.get("tokens", []),
                "floor_cached": floor.get("cached", []),
                "stored_seconds": stored.get("seconds", []),
                "stored_tokens": stored.get("tokens", []),
                "stored_cached": stored.get("cached", []),
                "kvwire_stats": stats,
            }
        )
    )


def time_loads(connector: Any, total: list[float]) -> None:
    """Add the time the engine's thread spends in ``connector``'s loads to ``total[0]``."""

    def timed(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - started

        return call

    connector.start_load_kv = timed(connector.start_load_kv)
    connector.wait_for_layer_load = timed(connector.wait_for_layer_load)


def plot(summary: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()
    models = summary["models"]
    figure, all_axes = plt.subplots(len(models), 1, figsize=(7.5, 2.6 * len(models)), squeeze=False)
    colors = ["#999999", "#d98c3f", "#3f7fd9", "#3fb07f", "#cccccc"]
    for axes, (model_name, table) in zip(all_axes[:, 0], models.items(), strict=True):
        names = list(table["configurations"])
        warm = [table["configurations"][name]["warm_ttft_p50_s"] * 1000 for name in names]
        bars = axes.barh(names, warm, color=colors[: len(names)])
        axes.bar_label(bars, labels=[f"{value:.0f} ms" for value in warm], padding=3)
        axes.invert_yaxis()
        axes.set_xscale("log")
        axes.set_xlim(min(warm) / 2, max(warm) * 4)  # room for the labels
        axes.set_title(f"{model_name}: {table['kv_mib_per_prompt']:.0f} MiB of KV per prompt")
    all_axes[-1, 0].set_xlabel("warm-pass time to first token, p50 (ms, log scale)")
    figure.suptitle(
        f"vLLM 0.32 CPU, {summary['prompts']} prompts of {summary['prompt_tokens']} tokens"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--engine":
        measure_engine(sys.argv[2])
    else:
        from benchmarks.common import main

        sys.exit(main("python -m benchmarks.vllm", run, sys.argv[1:]))
