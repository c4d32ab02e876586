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
connector's.
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
BLOCK_SIZE = 32
VOCAB = 4096
# Prefill of a 2k-token prompt takes about a second on two cores: it dominates the TTFT.
MODEL_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


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
    with tempfile.TemporaryDirectory(prefix="kvwire-vllm-bench-") as scratch:
        root = pathlib.Path(scratch)
        model = build_model(root / "model", quick)
        prompts = [
            [(index * 7919 + position * 31) % (VOCAB - 3) + 3 for position in range(prompt_tokens)]
            for index in range(num_prompts)
        ]
        results = {name: run_engine_process(name, model, prompts, root) for name in CONFIGURATIONS}
    baseline = results["no connector"]
    summary: dict[str, Any] = {
        "model": MODEL_SHAPE | ({"num_hidden_layers": 4} if quick else {}),
        "prompt_tokens": prompt_tokens,
        "prompts": num_prompts,
        "configurations": {},
    }
    for name, result in results.items():
        summary["configurations"][name] = {
            "cold_ttft_p50_s": statistics.median(result["cold_seconds"]),
            "warm_ttft_p50_s": statistics.median(result["warm_seconds"]),
            "warm_cached_tokens": result["warm_cached"],
            "warm_tokens_equal_no_connector": result["warm_tokens"] == baseline["warm_tokens"],
            "kvwire_blocks_loaded": result["kvwire_stats"].get("blocks_loaded", 0),
            "kvwire_load_errors": result["kvwire_stats"].get("load_errors", 0),
        }
    no_connector = summary["configurations"]["no connector"]["warm_ttft_p50_s"]
    example = summary["configurations"]["vLLM ExampleConnector"]["warm_ttft_p50_s"]
    for entry in summary["configurations"].values():
        entry["warm_vs_no_connector"] = entry["warm_ttft_p50_s"] / no_connector
        entry["warm_vs_example_connector"] = entry["warm_ttft_p50_s"] / example
    write_json(output_dir, "vllm.json", summary)
    plot(summary, output_dir / "vllm.png")
    return summary


def build_model(directory: pathlib.Path, quick: bool) -> str:
    """A random-weight Llama and a word-level tokenizer, saved for vLLM (no hub)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    shape = MODEL_SHAPE | ({"num_hidden_layers": 4} if quick else {})
    LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **shape)).save_pretrained(directory)
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(directory)
    return str(directory)


def transfer_config(name: str, scratch: pathlib.Path) -> dict[str, Any] | None:
    if name == "no connector":
        return None
    if name == "vLLM ExampleConnector":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(scratch / "example")},
        }
    repo = pathlib.Path(__file__).resolve().parents[1]
    if name == "kvwire CPU offload":
        profile: Any = str(repo / "containers" / "cpu-offload.yaml")
        extra = {"kvwire_profile": profile}
    else:
        import yaml

        mapping = yaml.safe_load((repo / "containers" / "shared-storage.yaml").read_text())
        storage = mapping["kv_transfer_config"]["kv_connector_extra_config"]
        storage["shared_storage_path"] = str(scratch / "kvwire-shared-storage")
        extra = {"kvwire": mapping}
    return {
        "kv_connector": "KVWireConnector",
        "kv_connector_module_path": "kvwire.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def run_engine_process(
    name: str, model: str, prompts: list[list[int]], scratch: pathlib.Path
) -> dict[str, Any]:
    """Run one configuration's engine in a new process; its measurements."""
    job = scratch / f"{name.replace(' ', '-')}.json"
    job.write_text(
        json.dumps(
            {
                "model": model,
                "prompts": prompts,
                "kv_transfer_config": transfer_config(name, scratch),
                "output": str(job.with_suffix(".out")),
            }
        )
    )
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
    }
    print(f"   {name} ...", flush=True)
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.vllm", "--engine", str(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"{name}: the engine process failed:\n{completed.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(job.with_suffix(".out").read_text())
    return result


def measure_engine(job_path: str) -> None:
    """The engine process: cold pass, saves settled, prefix cache emptied, warm pass."""
    from vllm import LLM, SamplingParams

    from kvwire.vllm import WORKER_EXTENSION, kvwire_stats, wait_for_saves

    job = json.loads(pathlib.Path(job_path).read_text())
    config = job["kv_transfer_config"]
    llm = LLM(
        job["model"],
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=4096,
        enable_prefix_caching=True,
        enforce_eager=True,
        distributed_executor_backend="uni",
        seed=0,
        kv_transfer_config=config,
        worker_extension_cls=WORKER_EXTENSION,
    )
    one_token = SamplingParams(max_tokens=1, temperature=0)

    def timed_pass() -> tuple[list[float], list[list[int]], list[int]]:
        seconds, tokens, cached = [], [], []
        for prompt in job["prompts"]:
            started = time.perf_counter()
            (output,) = llm.generate([{"prompt_token_ids": prompt}], one_token, use_tqdm=False)
            seconds.append(time.perf_counter() - started)
            tokens.append(list(output.outputs[0].token_ids))
            cached.append(output.num_cached_tokens)
        return seconds, tokens, cached

    llm.generate([{"prompt_token_ids": [5] * 64}], one_token, use_tqdm=False)  # warm-up
    cold_seconds, _, _ = timed_pass()
    uses_kvwire = config is not None and config["kv_connector"] == "KVWireConnector"
    if uses_kvwire:
        wait_for_saves(llm)
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not empty its prefix cache")
    warm_seconds, warm_tokens, warm_cached = timed_pass()
    # vLLM counts a failed load as cached too: kvwire's own counters tell.
    stats = kvwire_stats(llm) if uses_kvwire else {}
    pathlib.Path(job["output"]).write_text(
        json.dumps(
            {
                "cold_seconds": cold_seconds,
                "warm_seconds": warm_seconds,
                "warm_tokens": warm_tokens,
                "warm_cached": warm_cached,
                "kvwire_stats": stats,
            }
        )
    )


def plot(summary: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()
    names = list(summary["configurations"])
    warm = [summary["configurations"][name]["warm_ttft_p50_s"] * 1000 for name in names]
    figure, axes = plt.subplots(figsize=(7, 3.5))
    bars = axes.barh(names, warm, color=["#999999", "#d98c3f", "#3f7fd9", "#3fb07f"])
    axes.bar_label(bars, labels=[f"{value:.0f} ms" for value in warm], padding=3)
    axes.invert_yaxis()
    axes.set_xlim(0, max(warm) * 1.2)  # room for the labels
    axes.set_xlabel("warm-pass time to first token, p50 (ms)")
    axes.set_title(
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
