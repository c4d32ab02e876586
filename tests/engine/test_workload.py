"""Workloads: synthetic prompts with a shared prefix, JSONL prompt files, the byte tokenizer."""

from __future__ import annotations

import json
import pathlib

import pytest

from kvwire.engine.workload import (
    ByteTokenizer,
    WorkloadSpec,
    load_prompts_jsonl,
    synthetic_workload,
)


def test_every_synthetic_prompt_starts_with_the_shared_prefix() -> None:
    requests = synthetic_workload(
        WorkloadSpec(num_requests=5, prompt_len=40, shared_prefix_ratio=0.5, seed=1)
    )
    prefixes = {request.prompt_token_ids[:20] for request in requests}
    suffixes = {request.prompt_token_ids[20:] for request in requests}
    assert len(prefixes) == 1 and len(suffixes) == 5


def test_equal_specs_give_equal_workloads() -> None:
    spec = WorkloadSpec(num_requests=3, prompt_len=10, seed=9)
    assert synthetic_workload(spec) == synthetic_workload(spec)


def test_a_shared_prefix_ratio_above_one_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"shared_prefix_ratio must be between 0 and 1, got 1\.5"):
        WorkloadSpec(shared_prefix_ratio=1.5)


def test_the_byte_tokenizer_round_trips_utf8_text() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode("KV caché ✓")) == "KV caché ✓"


def _write(path: pathlib.Path, *records: object) -> pathlib.Path:
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    return path


def test_a_jsonl_file_mixes_text_and_token_id_prompts(tmp_path: pathlib.Path) -> None:
    path = _write(
        tmp_path / "prompts.jsonl",
        {"prompt": "hi", "max_tokens": 3},
        {"prompt_token_ids": [5, 6, 7], "request_id": "mine"},
    )
    first, second = load_prompts_jsonl(path, default_max_tokens=8, vocab_size=512)
    assert first.prompt_token_ids == (104, 105) and first.max_tokens == 3
    assert second.request_id == "mine" and second.max_tokens == 8


def test_a_jsonl_line_with_an_unknown_field_names_the_line_and_field(
    tmp_path: pathlib.Path,
) -> None:
    path = _write(tmp_path / "p.jsonl", {"prompt": "ok"}, {"promt": "typo"})
    with pytest.raises(ValueError, match=r"p.jsonl:2: unknown field 'promt'; accepted fields are"):
        load_prompts_jsonl(path, default_max_tokens=4, vocab_size=512)


def test_token_ids_outside_the_vocabulary_are_rejected(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path / "p.jsonl", {"prompt_token_ids": [1, 900]})
    with pytest.raises(
        ValueError, match=r"prompt_token_ids must be a non-empty list of ints in \[0, 512\)"
    ):
        load_prompts_jsonl(path, default_max_tokens=4, vocab_size=512)


def test_text_prompts_need_a_vocabulary_of_at_least_256(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path / "p.jsonl", {"prompt": "abc"})
    with pytest.raises(ValueError, match=r"text prompts need model_config.vocab_size >= 256"):
        load_prompts_jsonl(path, default_max_tokens=4, vocab_size=100)


def test_a_line_that_is_not_json_is_reported_with_its_number(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not valid JSON"):
        load_prompts_jsonl(path, default_max_tokens=4, vocab_size=512)
