"""Workloads for the engine: synthetic prompts with a shared prefix, or a JSONL file.

A JSONL prompt file has one object per line, either `{"prompt": "text"}`
(encoded by `ByteTokenizer`) or `{"prompt_token_ids": [1, 2, 3]}`,
each optionally with `"max_tokens"` and `"request_id"`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import attrs
from attrs import validators

from kvwire.common.redaction import shown
from kvwire.config.bounded_file import shown_path
from kvwire.config.json_lines import json_records
from kvwire.engine.engine import GenerationRequest

# A prompts file is read whole: bounded so that a wrong path (a log, a disk
# image, /dev/zero) is refused, not read into memory. 16 MiB holds 100,000
# prompts of about 160 bytes, or a few of the longest any model takes.
MAX_PROMPTS_BYTES = 16 * 1024 * 1024
MAX_PROMPTS_LINES = 100_000


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
    """A synthetic workload: `num_requests` prompts of `prompt_len` tokens.

    The first `round(prompt_len * shared_prefix_ratio)` tokens are the same
    in every prompt (a system prompt, a shared document); the rest is drawn
    per request from `seed`.
    """

    num_requests: int = attrs.field(default=16, validator=[validators.instance_of(int), _positive])
    prompt_len: int = attrs.field(default=256, validator=[validators.instance_of(int), _positive])
    output_len: int = attrs.field(default=16, validator=[validators.instance_of(int), _positive])
    shared_prefix_ratio: float = attrs.field(default=0.75, converter=float, validator=_ratio)
    vocab_size: int = attrs.field(default=512, validator=[validators.instance_of(int), _positive])
    seed: int = attrs.field(default=0, validator=validators.instance_of(int))


def synthetic_workload(spec: WorkloadSpec) -> list[GenerationRequest]:
    """The requests `spec` describes; equal specs give equal requests."""
    rng = random.Random(spec.seed)
    shared_len = round(spec.prompt_len * spec.shared_prefix_ratio)
    prefix = [rng.randrange(spec.vocab_size) for _ in range(shared_len)]
    requests: list[GenerationRequest] = []
    for index in range(spec.num_requests):
        suffix = [rng.randrange(spec.vocab_size) for _ in range(spec.prompt_len - shared_len)]
        requests.append(GenerationRequest(f"req-{index}", tuple(prefix + suffix), spec.output_len))
    return requests


def renamed_requests(workload: Sequence[GenerationRequest], suffix: str) -> list[GenerationRequest]:
    """The workload under new request ids, each suffixed `/suffix`: an engine keeps every id it
    has run, so a second pass over the same requests needs ids of its own."""
    return [attrs.evolve(r, request_id=f"{r.request_id}/{suffix}") for r in workload]


def load_prompts_jsonl(
    path: str | os.PathLike[str],
    default_max_tokens: int,
    vocab_size: int,
    max_model_len: int | None = None,
) -> list[GenerationRequest]:
    """The requests in a JSONL prompt file; errors name the file, the line and the field.

    The file must be a regular file of at most `MAX_PROMPTS_BYTES`
    bytes and `MAX_PROMPTS_LINES` lines (a FIFO, `/dev/zero` or
    `/dev/stdin` is refused before anything is read). With
    `max_model_len`, a request whose prompt and `max_tokens` together
    exceed it is refused by its line.
    """
    where_file = shown_path(path)
    records = json_records(
        path,
        max_bytes=MAX_PROMPTS_BYTES,
        max_lines=MAX_PROMPTS_LINES,
        kind="prompts file",
        items="prompts",
        record="a prompt record",
    )
    tokenizer = ByteTokenizer()
    requests: list[GenerationRequest] = []
    for where, record in records:
        request = _request_from_record(
            record, where, len(requests), default_max_tokens, vocab_size, tokenizer
        )
        if max_model_len is not None:
            _check_length(request, where, max_model_len)
        requests.append(request)
    if not requests:
        raise ValueError(f"{where_file}: no prompts in the file")
    return requests


def _check_length(request: GenerationRequest, where: str, max_model_len: int) -> None:
    prompt_len = len(request.prompt_token_ids)
    if prompt_len + request.max_tokens > max_model_len:
        raise ValueError(
            f"{where}: the prompt ({prompt_len} tokens) and max_tokens ({request.max_tokens}) "
            f"exceed model_config.max_model_len ({max_model_len}); shorten the prompt or "
            "max_tokens (the default of a line without one), or raise max_model_len in the "
            "profile"
        )


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
            f"{where}: unknown field {shown(sorted(unknown)[0])}; accepted fields are "
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
        raise ValueError(f"{where}: max_tokens must be an int >= 1, got {shown(max_tokens)}")
    request_id = record.get("request_id", f"req-{index}")
    if not isinstance(request_id, str):
        raise ValueError(f"{where}: request_id must be a string, got {shown(request_id)}")
    return GenerationRequest(request_id, tuple(token_ids), max_tokens)
