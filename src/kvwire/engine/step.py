"""What crosses between the engine's scheduler and its worker, once per step.

Plain picklable records: in process mode they travel through a pipe, so the
worker shares nothing with the scheduler but these bytes.
"""

from __future__ import annotations

import attrs

from kvwire.interface.base import KVConnectorMetadata
from kvwire.interface.types import KVConnectorOutput


@attrs.frozen
class ScheduledChunk:
    """One request's tokens to compute in a step.

    `token_ids` are the tokens at positions `[start_position,
    start_position + len(token_ids))`; `block_ids` holds the request's
    blocks, one tuple per KV cache group; `sample` is True when the chunk
    ends the known tokens, so its last row's logits give the next token.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[tuple[int, ...], ...]
    sample: bool


@attrs.frozen
class WorkerStep:
    """Everything the worker needs for one step."""

    chunks: tuple[ScheduledChunk, ...]
    finished_req_ids: frozenset[str]
    connector_metadata: KVConnectorMetadata | None
    scrub_block_ids: frozenset[int] = frozenset()
    """Blocks whose loads failed since the last step: zeroed before anything of this step runs.

    Whatever the connector left in them is never read, even by a request
    given one of them as its partly filled last block.
    """


@attrs.frozen
class StepResult:
    """What the worker reports back: the sampled tokens and the connector's output."""

    sampled_token_ids: dict[str, int]
    connector_output: KVConnectorOutput | None
