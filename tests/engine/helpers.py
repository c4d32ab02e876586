"""Helpers for the engine tests: run a workload, compare outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput


def generate(
    config: EngineConfig, workload: Sequence[GenerationRequest], **engine_options: Any
) -> list[RequestOutput]:
    """Run ``workload`` on a fresh engine and close it."""
    with LLMEngine(config, **engine_options) as engine:
        return engine.generate(workload)


def tokens(outputs: Sequence[RequestOutput]) -> list[tuple[int, ...]]:
    return [output.output_token_ids for output in outputs]


def served_from_connector(outputs: Sequence[RequestOutput]) -> int:
    return sum(output.external_tokens for output in outputs)
