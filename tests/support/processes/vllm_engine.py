"""One vLLM engine in its own process: ``python -m tests.support.processes.vllm_engine JOB.json``.

The job names the model, vLLM's ``kv_transfer_config``, further engine
arguments (``engine_args``: a tensor-parallel size, say), the prompts, how
many tokens to generate and how many passes to make (or ``prompt_passes``,
each pass's own prompts); each pass generates, waits
for kvwire's saves and empties vLLM's prefix cache. With
``kv_transfer_params``, every request carries them (what a router hands a
prefill engine for vLLM's NixlConnector), the outputs' own are kept, and the
pass neither waits nor empties the cache: the engine keeps the prompts' blocks
until a decode engine read them. The process writes
``{"tokens", "cached", "kv_transfer_params"}`` (one list per pass) and
``"stats"`` (kvwire's totals) to the job's ``output`` path. With ``hold_until`` (a path), the
engine then stays up, its memory readable by peers, until that file exists
(at most ``hold_s`` seconds). The environment (in-process engine core or
not) is the caller's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main(job_path: str) -> None:
    from vllm import SamplingParams

    import kvwire.vllm
    from tests.support.vllm import start_llm, stop_llm

    with open(job_path, encoding="utf-8") as job_file:
        job = json.load(job_file)
    llm = start_llm(job["model"], job["kv_transfer_config"], **job.get("engine_args", {}))
    try:
        result: dict[str, list[Any]] = {"tokens": [], "cached": [], "kv_transfer_params": []}
        # Each pass its own prompts, or the same prompts every pass.
        prompt_passes = job.get("prompt_passes") or [job["prompts"]] * job["passes"]
        transfer_params = job.get("kv_transfer_params")
        extra_args = {"kv_transfer_params": transfer_params} if transfer_params else None
        for prompts in prompt_passes:
            outputs = llm.generate(
                prompts,
                SamplingParams(max_tokens=job["max_tokens"], temperature=0, extra_args=extra_args),
                use_tqdm=False,
            )
            if not transfer_params:
                kvwire.vllm.wait_for_saves(llm)
                assert llm.reset_prefix_cache()
            result["tokens"].append([list(output.outputs[0].token_ids) for output in outputs])
            result["cached"].append([output.num_cached_tokens for output in outputs])
            result["kv_transfer_params"].append([output.kv_transfer_params for output in outputs])
        stats = kvwire.vllm.kvwire_stats(llm)
        if job.get("hold_until"):
            _write(job["output"], {**result, "stats": stats})
            deadline = time.monotonic() + job.get("hold_s", 300)
            while not os.path.exists(job["hold_until"]) and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        stop_llm(llm)
    _write(job["output"], {**result, "stats": stats})


def _write(path: str, result: dict[str, Any]) -> None:
    # Renamed into place: a reader polling for the file never sees half of it.
    with open(f"{path}.tmp", "w", encoding="utf-8") as output_file:
        json.dump(result, output_file)
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":  # vLLM's CPU backend starts its processes by spawning
    main(sys.argv[1])
