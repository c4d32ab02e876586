"""A request trace in JSONL, the form public production traces use: read bounded, and written.

One request a line, a JSON object with `timestamp` (when it arrived, a
number), `input_length` and `output_length` (its prompt's and its answer's
tokens) and `hash_ids`: one id per block of the prompt, equal ids for equal
prefixes (an id names its block together with every block before it, as
the engine's chained block hashes do). Other fields are ignored: traces
carry more (a session, a model) that a pool's hits do not depend on.

The file is read whole, so it is bounded like every file kvwire reads (a
regular file of at most `MAX_TRACE_BYTES` bytes, `MAX_TRACE_LINES` lines of
at most `MAX_LINE_BYTES` bytes, `MAX_BLOCKS_PER_REQUEST` ids a request);
each refusal names the file and line and says what was expected.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import TextIO

import attrs

from kvwire.common.redaction import kind_of
from kvwire.config.bounded_file import shown_path
from kvwire.config.json_lines import json_records
from kvwire.interface.types import BlockHash

# 256 MiB holds about 30 million block ids of six digits: a month of a busy
# service's prompts, and as much as a replay gets through in a few minutes a
# configuration. Read into memory whole, it takes a few GiB at most.
MAX_TRACE_BYTES = 256 * 1024 * 1024
MAX_TRACE_LINES = 10_000_000
# A request of MAX_BLOCKS_PER_REQUEST ids of 20 digits, with its other fields.
MAX_LINE_BYTES = 2 * 1024 * 1024
# 65536 blocks of 16 tokens: a prompt of a million tokens, longer than any model takes.
MAX_BLOCKS_PER_REQUEST = 65536
# Block ids are 64-bit: what a hash of a block's contents is, in every trace published.
HASH_ID_LIMIT = 2**64
# Token counts: longer than any context, far below what an id or a float cannot hold.
MAX_TOKENS = 2**40

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@attrs.frozen
class TraceRequest:
    """One request of a trace: when it arrived, its lengths in tokens and its prompt's blocks."""

    timestamp: float
    input_length: int
    output_length: int
    block_hashes: tuple[BlockHash, ...]
    """The prompt's blocks, each id as the block hash the pool keys it by (`block_hash`)."""


def block_hash(hash_id: int) -> BlockHash:
    """The block hash a trace's block id stands for: its 8 bytes, big-endian."""
    return hash_id.to_bytes(8, "big")


def hash_id(block: BlockHash) -> int:
    """The trace's block id of a block hash of 8 bytes (`block_hash` undone)."""
    return int.from_bytes(block, "big")


def read_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """The requests of the JSONL trace at `path`, in the order they arrived.

    Sorted by `timestamp` (requests of the same time keep the file's order):
    a trace merged from several servers is replayed as the pool would have
    seen it. A `ValueError` names the file, the line and what was expected.
    """
    where_file = shown_path(path)
    records = json_records(
        path,
        max_bytes=MAX_TRACE_BYTES,
        max_lines=MAX_TRACE_LINES,
        kind="trace",
        items="requests",
        record="a trace record",
        max_line_bytes=MAX_LINE_BYTES,
    )
    # One bytes object per distinct id: the replay's lookups hash each once.
    hashes: dict[int, BlockHash] = {}
    requests: list[TraceRequest] = []
    for where, record in records:
        requests.append(_request(record, where, hashes))
    if not requests:
        raise ValueError(f"{where_file}: no requests in the file; a trace has one a line")
    requests.sort(key=lambda request: request.timestamp)
    return requests


def _request(record: dict[str, object], where: str, hashes: dict[int, BlockHash]) -> TraceRequest:
    missing = [field for field in FIELDS if field not in record]
    if missing:
        raise ValueError(f"{where}: no field {missing[0]!r}; each line needs {', '.join(FIELDS)}")
    timestamp = record["timestamp"]
    if (
        not isinstance(timestamp, int | float)
        or isinstance(timestamp, bool)
        or not math.isfinite(timestamp)
        or timestamp < 0
    ):
        raise ValueError(f"{where}: timestamp must be a number >= 0, got {_kind(timestamp)}")
    lengths = [_token_count(record, field, where) for field in ("input_length", "output_length")]
    ids = record["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"{where}: hash_ids must be a list of ints, got {kind_of(ids)}")
    if len(ids) > MAX_BLOCKS_PER_REQUEST:
        raise ValueError(
            f"{where}: hash_ids holds {len(ids)} ids, more than the {MAX_BLOCKS_PER_REQUEST} "
            "a request may (one id per block of the prompt)"
        )
    if not all(type(value) is int for value in ids) or (
        ids and not (min(ids) >= 0 and max(ids) < HASH_ID_LIMIT)
    ):
        raise ValueError(
            f"{where}: hash_ids must be a list of ints from 0 to {HASH_ID_LIMIT - 1}, "
            "one per block of the prompt"
        )
    blocks = []
    for value in ids:
        block = hashes.get(value)
        if block is None:
            block = hashes[value] = block_hash(value)
        blocks.append(block)
    return TraceRequest(float(timestamp), lengths[0], lengths[1], tuple(blocks))


def _token_count(record: dict[str, object], field: str, where: str) -> int:
    value = record[field]
    if type(value) is not int or not 0 <= value <= MAX_TOKENS:
        raise ValueError(
            f"{where}: {field} must be a whole number of tokens from 0 to {MAX_TOKENS}, "
            f"got {_kind(value)}"
        )
    return value


def _kind(value: object) -> str:
    """A number as it is (bounded), anything else by its type: never a long value."""
    if type(value) in (int, float) and len(repr(value)) <= 40:
        return repr(value)
    return kind_of(value)


def write_trace(requests: Iterable[TraceRequest], out: TextIO) -> None:
    """Each request as a line of the JSONL form `read_trace` reads (block hashes of 8 bytes)."""
    for request in requests:
        record = {
            "timestamp": _number(request.timestamp),
            "input_length": request.input_length,
            "output_length": request.output_length,
            "hash_ids": [hash_id(block) for block in request.block_hashes],
        }
        out.write(json.dumps(record, separators=(", ", ": ")) + "\n")


def _number(value: float) -> int | float:
    # Whole milliseconds, as the public traces write them, stay ints.
    return int(value) if value.is_integer() else value


def accesses(requests: Sequence[TraceRequest]) -> list[BlockHash]:
    """Every block asked for, request after request: what Belady's optimum replays."""
    return [block for request in requests for block in request.block_hashes]
