"""Synthetic traces shaped like serving traffic, to try a replay on (and the tiers benchmark's).

Seeded, so every run with the same shape sees the same trace. Every shape
mixes the same parts in other proportions: Zipf-popular system prompts and
documents shared by many requests, multi-turn sessions whose prompt grows
by a few blocks each turn, and one-off prompts, whose own blocks are never
asked for again. `SHAPES` names the shapes shipped:

- `mixed`: the tiers benchmark's traffic: short system prompts, a third of
  the prompts one-off, sessions of four turns on average, half of them
  over a document;
- `conversation`: shaped like public traces of production chat traffic:
  long shared system prompts, half the prompts one-off and long, hundreds
  of sessions open at once, each turn adding the last answer and the next
  question; most blocks are used once;
- `agent`: an agent's tool loop: few sessions of many turns (one in twelve
  ends a turn), each adding a tool's output, over a long system prompt
  listing the tools, and few one-off prompts;
- `rag`: retrieval-augmented questions: most prompts a system prompt, a
  document from a large Zipf-popular collection and a one-off question,
  beside short sessions.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import attrs

from kvwire.interface.types import BlockHash
from kvwire.replay.trace import TraceRequest

Trace = list[list[BlockHash]]
"""One list of block hashes per request, in arrival order."""

# What a generated request says of itself beside its blocks: vLLM's default
# block size, a fixed answer length and a request every 100 milliseconds.
BLOCK_TOKENS = 16
OUTPUT_TOKENS = 128
INTERVAL_MS = 100


@attrs.frozen
class TraceShape:
    """What the generated traffic looks like; block counts are in blocks."""

    requests: int
    system_prompts: int = 30
    system_prompt_blocks: int = 4
    documents: int = 300
    document_blocks: int = 12
    zipf_s: float = 1.1
    one_off_share: float = 0.35
    new_session_share: float = 0.2
    one_off_blocks: tuple[int, int] = (4, 16)
    turn_blocks: tuple[int, int] = (2, 4)
    session_end_chance: float = 0.25
    active_sessions: int = 48
    seed: int = 33
    one_off_document_share: float = 0.3
    """The share of one-off prompts that follow their system prompt with a document."""
    session_document_share: float = 0.5
    """The share of sessions whose first prompt follows its system prompt with a document."""


SHAPES: dict[str, TraceShape] = {
    "mixed": TraceShape(requests=6000),
    "conversation": TraceShape(
        requests=4000,
        system_prompts=200,
        system_prompt_blocks=24,
        documents=2000,
        document_blocks=16,
        zipf_s=0.8,
        one_off_share=0.5,
        new_session_share=0.15,
        one_off_blocks=(16, 120),
        turn_blocks=(8, 40),
        session_end_chance=0.3,
        active_sessions=300,
        one_off_document_share=0.1,
        session_document_share=0.1,
    ),
    "agent": TraceShape(
        requests=6000,
        system_prompts=6,
        system_prompt_blocks=60,
        documents=100,
        document_blocks=8,
        one_off_share=0.1,
        new_session_share=0.06,
        one_off_blocks=(4, 24),
        turn_blocks=(1, 8),
        session_end_chance=0.08,
        active_sessions=24,
        one_off_document_share=0.0,
        session_document_share=0.2,
    ),
    "rag": TraceShape(
        requests=6000,
        system_prompts=4,
        system_prompt_blocks=8,
        documents=3000,
        document_blocks=24,
        zipf_s=0.9,
        one_off_share=0.6,
        new_session_share=0.15,
        one_off_blocks=(1, 4),
        turn_blocks=(1, 3),
        session_end_chance=0.4,
        active_sessions=64,
        one_off_document_share=1.0,
        session_document_share=0.8,
    ),
}
"""The shapes `kvwire replay --generate --shape NAME` writes (seed 33)."""
DEFAULT_SHAPE = "mixed"


def named_shape(name: str) -> TraceShape:
    """The shape `SHAPES` names; a `ValueError` lists the names accepted."""
    shape = SHAPES.get(name)
    if shape is None:
        raise ValueError(f"no trace shape named {name!r}; expected one of {', '.join(SHAPES)}")
    return shape


class _Blocks:
    """Block hashes chained as the engine's are: a block's hash names its whole prefix."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}
        self._fresh = itertools.count(1)

    def extend(self, prefix: list[BlockHash], contents: Sequence[object]) -> list[BlockHash]:
        hashes = list(prefix)
        parent = int.from_bytes(hashes[-1], "big") if hashes else 0
        for content in contents:
            key = (parent, content)
            block = self._ids.get(key)
            if block is None:
                block = self._ids[key] = next(self._fresh)
            parent = block
            hashes.append(block.to_bytes(8, "big"))
        return hashes


def _zipf_weights(count: int, s: float) -> list[float]:
    return list(itertools.accumulate(1 / rank**s for rank in range(1, count + 1)))


def generate_trace(shape: TraceShape) -> Trace:
    """The requests' block hashes, seeded by `shape.seed`."""
    rng = random.Random(shape.seed)
    blocks = _Blocks()
    unique = itertools.count()
    system_weights = _zipf_weights(shape.system_prompts, shape.zipf_s)
    document_weights = _zipf_weights(shape.documents, shape.zipf_s)

    def shared_prefix(with_document: bool) -> list[BlockHash]:
        system = rng.choices(range(shape.system_prompts), cum_weights=system_weights)[0]
        prefix = blocks.extend(
            [], [("system", system, i) for i in range(shape.system_prompt_blocks)]
        )
        if with_document:
            document = rng.choices(range(shape.documents), cum_weights=document_weights)[0]
            prefix = blocks.extend(
                prefix, [("document", document, i) for i in range(shape.document_blocks)]
            )
        return prefix

    def fresh(low_high: tuple[int, int]) -> list[object]:
        return [("unique", next(unique)) for _ in range(rng.randint(*low_high))]

    sessions: list[list[BlockHash]] = []
    trace: Trace = []
    for _ in range(shape.requests):
        draw = rng.random()
        if draw < shape.one_off_share:
            trace.append(
                blocks.extend(
                    shared_prefix(rng.random() < shape.one_off_document_share),
                    fresh(shape.one_off_blocks),
                )
            )
            continue
        if draw < shape.one_off_share + shape.new_session_share or not sessions:
            prompt = blocks.extend(
                shared_prefix(rng.random() < shape.session_document_share), fresh(shape.turn_blocks)
            )
            if len(sessions) >= shape.active_sessions:
                sessions.pop(rng.randrange(len(sessions)))
            sessions.append(prompt)
            trace.append(prompt)
            continue
        # The next turn: the last prompt, its answer and the next question.
        position = rng.randrange(len(sessions))
        prompt = blocks.extend(sessions[position], fresh(shape.turn_blocks))
        trace.append(prompt)
        if rng.random() < shape.session_end_chance:
            sessions.pop(position)
        else:
            sessions[position] = prompt
    return trace


def generate_requests(shape: TraceShape) -> list[TraceRequest]:
    """`generate_trace`'s requests as a trace file holds them, `INTERVAL_MS` apart."""
    return [
        TraceRequest(
            timestamp=float(index * INTERVAL_MS),
            input_length=len(hashes) * BLOCK_TOKENS,
            output_length=OUTPUT_TOKENS,
            block_hashes=tuple(hashes),
        )
        for index, hashes in enumerate(generate_trace(shape))
    ]
