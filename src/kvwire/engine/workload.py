"""Workloads for the engine: synthetic prompts with a shared prefix, or a JSONL file.

A JSONL prompt file has one object per line, either ``{"prompt": "text"}``
(encoded by :class:`ByteTokenizer`) or ``{"prompt_token_ids": [1, 2, 3]}``,
each optionally with ``"max_tokens"`` and ``"request_id"``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence

import attrs
from attrs import validators

from kvwire.engine.engine import GenerationRequest


class ByteTokenizer:
    """Text to token ids and back, one token per UTF-8 byte (ids 0..255)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


def _ratio(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be between 0 and 1, got {value}")


@attrs.frozen(kw_only=True)
class WorkloadSpec:
    """A synthetic workload: ``num_requests`` prompts of ``prompt_len`` tokens.

    The first ``round(prompt_len * shared_prefix_ratio)`` tokens are the same
    in every prompt (a system prompt, a shared document); the rest is drawn
    per request from ``seed``.
    """

    num_requests: int = attrs.field(default=16, validator=[validators.instance_of(int), _positive])
    prompt_len: int = attrs.field(default=256, validator=[validators.instance_of(int), _positive])
    output_len: int = attrs.field(default=16, validator=[validators.instance_of(int), _positive])
    shared_prefix_ratio: float = attrs.field(default=0.75, converter=float, validator=_ratio)
    vocab_size: int = attrs.field(default=512, validator=[validators.instance_of(int), _positive])
    seed: int = attrs.field(default=0, validator=validators.instance_of(int))


def synthetic_workload(spec: WorkloadSpec) -> list[GenerationRequest]:
    """The requests ``spec`` describes; equal specs give equal requests."""
    rng = random.Random(spec.seed)
    shared_len = round(spec.prompt_len * spec.shared_prefix_ratio)
    prefix = [rng.randrange(spec.vocab_size) for _ in range(shared_len)]
    requests: list[GenerationRequest] = []
    for index in range(spec.num_requests):
        suffix = [rng.randrange(spec.vocab_size) for _ in range(spec.prompt_len - shared_len)]
        requests.append(GenerationRequest(f"req-{index}", tuple(prefix + suffix), spec.output_len))
    return requests


def load_prompts_jsonl(
    path: str | os.PathLike[str], default_max_tokens: int, vocab_size: int
) -> list[GenerationRequest]:
    """The requests in a JSONL prompt file; errors name the line and the field."""
    tokenizer = ByteTokenizer()
    requests: list[GenerationRequest] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            requests.append(
                _request_from_record(
                    record, where, len(requests), default_max_tokens, vocab_size, tokenizer
                )
            )
    if not requests:
        raise ValueError(f"{os.fspath(path)}: no prompts in the file")
    return requests


def _request_from_record(
    record: dict[str, object],
    where: str,
    index: int,
    default_max_tokens: int,
    vocab_size: int,
    tokenizer: ByteTokenizer,
) -> GenerationRequest:
    unknown = set(record) - {"prompt", "prompt_token_ids", "max_tokens", "request_id"}
    if unknown:
        raise ValueError(
            f"{where}: unknown field {sorted(unknown)[0]!r}; accepted fields are "
            "prompt, prompt_token_ids, max_tokens, request_id"
        )
    if ("prompt" in record) == ("prompt_token_ids" in record):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text) or 'prompt_token_ids'")
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{where}: prompt must be a non-empty string")
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"{where}: text prompts need model_config.vocab_size >= {tokenizer.vocab_size} "
                f"(byte-level tokenizer), got {vocab_size}"
            )
        token_ids = tokenizer.encode(text)
    else:
        token_ids_value = record["prompt_token_ids"]
        if (
            not isinstance(token_ids_value, list)
            or not token_ids_value
            or not all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids_value)
        ):
            raise ValueError(
                f"{where}: prompt_token_ids must be a non-empty list of ints in [0, {vocab_size})"
            )
        token_ids = token_ids_value
    max_tokens = record.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an int >= 1, got {max_tokens!r}")
    request_id = record.get("request_id", f"req-{index}")
    if not isinstance(request_id, str):
        raise ValueError(f"{where}: request_id must be a string, got {request_id!r}")
    return GenerationRequest(request_id, tuple(token_ids), max_tokens)
