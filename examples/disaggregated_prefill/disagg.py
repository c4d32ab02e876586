"""Disaggregated prefill through Redis: one engine computes prompts, another decodes them.

Run each role as its own process (on one host or several), against one
Redis/Valkey server::

    python examples/disaggregated_prefill/disagg.py prefill --redis-url redis://HOST:6379/0
    python examples/disaggregated_prefill/disagg.py decode  --redis-url redis://HOST:6379/0

- ``prefill`` runs the engine of the shipped profile ``disagg-prefill``
  (``kv_producer``): it computes every prompt (and its first token) and its
  connector saves the prompt's KV blocks to Redis;
- ``decode`` runs the engine of the shipped profile ``disagg-decode``
  (``kv_consumer``): it loads the prompt blocks from Redis instead of
  computing them, and generates ``--max-tokens`` tokens;
- ``single`` runs one engine without a connector doing both, for comparison:
  its tokens are what ``decode`` must produce.

Each writes a JSON report (tokens, tokens served by the connector, stats) to
``--output`` or stdout, and says on stderr what it did. Prompts are synthetic
(``--num-requests``, ``--prompt-len``, ``--seed``) or read from a JSONL file
(``--prompts``). ``prefill`` and ``decode`` exit 1 when Redis cannot be
reached, before the run or during it: kvwire's Redis medium rides out an
outage (lookups miss, saves are dropped), which would make a run without a
server look like a success.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import attrs

from kvwire.common.redaction import redact_text
from kvwire.config import EngineConfig
from kvwire.config.profile import load_profile
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.engine.workload import WorkloadSpec, load_prompts_jsonl, synthetic_workload

# Shipped profiles, by name: the example runs from any folder.
PROFILES = {
    "prefill": "disagg-prefill",
    "decode": "disagg-decode",
    "single": "disagg-decode",  # the same model, without the connector
}


def engine_config(role: str, redis_url: str | None, key_prefix: str | None) -> EngineConfig:
    """The role's profile, with the Redis URL and key prefix given on the command line."""
    config = load_profile(PROFILES[role])
    transfer = config.kv_transfer_config
    if role == "single" or transfer is None:
        return attrs.evolve(config, kv_transfer_config=None)
    extra = dict(transfer.kv_connector_extra_config)
    if redis_url is not None:
        extra["url"] = redis_url
    if key_prefix is not None:
        extra["key_prefix"] = key_prefix
    return attrs.evolve(
        config, kv_transfer_config=attrs.evolve(transfer, kv_connector_extra_config=extra)
    )


def requests_for(args: argparse.Namespace, config: EngineConfig) -> list[GenerationRequest]:
    # The prefill engine only needs the prompt's KV (and the first token).
    max_tokens = 1 if args.role == "prefill" else args.max_tokens
    vocab_size = config.model_config.vocab_size
    if args.prompts is not None:
        loaded = load_prompts_jsonl(args.prompts, max_tokens, vocab_size)
        return [attrs.evolve(request, max_tokens=max_tokens) for request in loaded]
    spec = WorkloadSpec(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=max_tokens,
        shared_prefix_ratio=0.0,
        vocab_size=vocab_size,
        seed=args.seed,
    )
    return synthetic_workload(spec)


class RedisUnreachable(Exception):
    """The role's Redis server did not answer: the run would move nothing."""


def redis_url_of(config: EngineConfig) -> str | None:
    transfer = config.kv_transfer_config
    return None if transfer is None else str(transfer.kv_connector_extra_config["url"])


def check_reachable(url: str) -> None:
    """PING a single server, with a short deadline, before an engine is built for it.

    A cluster's URL (``redis+cluster://``) is kvwire's own: its reachability
    shows in the run's counters instead.
    """
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    except ValueError:
        return
    try:
        client.ping()
    except redis.RedisError as error:
        raise RedisUnreachable(
            f"cannot reach Redis at {redact_text(url)} ({type(error).__name__}); start one "
            "(redis-server --port 6390 --save '') and pass its URL with --redis-url"
        ) from None
    finally:
        client.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config(args.role, args.redis_url, args.key_prefix)
    url = redis_url_of(config)
    if url is not None:
        check_reachable(url)
    requests = requests_for(args, config)
    # Closing the engine waits until every save is in Redis.
    with LLMEngine(config) as engine:
        outputs = engine.generate(requests)
        stats = engine.connector_stats.data
    outage = {name: stats.get(name, 0) for name in ("lookup_failures", "saves_dropped")}
    if url is not None and any(outage.values()):
        raise RedisUnreachable(
            f"Redis at {redact_text(url)} did not answer during the run ({outage}): the "
            "report would not show what a working server gives"
        )
    return {
        "role": args.role,
        "requests": [
            {
                "request_id": output.request_id,
                "output_token_ids": list(output.output_token_ids),
                "external_tokens": output.external_tokens,
                "status": output.status.value,
                "error": output.error,
            }
            for output in outputs
        ],
        "connector_stats": stats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=sorted(PROFILES))
    parser.add_argument("--redis-url", help="overrides the profile's url")
    parser.add_argument("--key-prefix", help="overrides the profile's key_prefix")
    parser.add_argument("--prompts", type=pathlib.Path, help="a JSONL prompt file")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=pathlib.Path, help="where to write the JSON report")
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except RedisUnreachable as error:
        print(f"disagg.py {args.role}: {error}", file=sys.stderr)
        return 1
    report = json.dumps(result, indent=2)
    if args.output is None:
        print(report)
    else:
        args.output.write_text(report)
    print(f"disagg.py {args.role}: {summary(result)}", file=sys.stderr)
    return 0


def summary(result: dict[str, Any]) -> str:
    """One line: what the role computed and what moved through Redis."""
    requests = result["requests"]
    stats = result["connector_stats"]
    finished = sum(1 for request in requests if request["error"] is None)
    line = f"{finished} of {len(requests)} requests finished"
    if result["role"] == "prefill":
        line += f"; {stats.get('blocks_saved', 0)} prompt blocks saved to Redis"
    elif result["role"] == "decode":
        external = sum(request["external_tokens"] for request in requests)
        line += f"; {external} prompt tokens loaded from Redis instead of computed"
    return line


if __name__ == "__main__":
    sys.exit(main())
