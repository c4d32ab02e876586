"""The JSONL trace reader: every refusal names the file, the line and what was expected."""

from __future__ import annotations

import io
import json
import pathlib

import attrs
import pytest

from kvwire.replay.synthetic import (
    SHAPES,
    TraceShape,
    generate_requests,
    generate_trace,
    named_shape,
)
from kvwire.replay.trace import (
    MAX_BLOCKS_PER_REQUEST,
    MAX_LINE_BYTES,
    TraceRequest,
    block_hash,
    read_trace,
    write_trace,
)

GOOD = {"timestamp": 0, "input_length": 32, "output_length": 8, "hash_ids": [1, 2]}


def trace_file(tmp_path: pathlib.Path, *lines: object) -> pathlib.Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


def refusal(path: pathlib.Path) -> str:
    with pytest.raises(ValueError) as error:
        read_trace(path)
    return str(error.value)


def test_a_trace_reads_as_requests_in_arrival_order(tmp_path: pathlib.Path) -> None:
    later = {**GOOD, "timestamp": 20.5, "hash_ids": [1, 3], "session": "extra fields ignored"}
    path = trace_file(tmp_path, later, "", {**GOOD, "timestamp": 10})
    assert read_trace(path) == [
        TraceRequest(10.0, 32, 8, (block_hash(1), block_hash(2))),
        TraceRequest(20.5, 32, 8, (block_hash(1), block_hash(3))),
    ]


def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path: pathlib.Path) -> None:
    path = trace_file(tmp_path, GOOD, "{not json")
    assert refusal(path).startswith(f"{path}:2: not valid JSON (")


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({**GOOD, "hash_ids": "1,2"}, "hash_ids must be a list of ints, got a str"),
        ({**GOOD, "hash_ids": [1, "2"]}, "hash_ids must be a list of ints from 0 to "),
        ({**GOOD, "hash_ids": [1, -2]}, "hash_ids must be a list of ints from 0 to "),
        ({**GOOD, "hash_ids": [True]}, "hash_ids must be a list of ints from 0 to "),
        ({**GOOD, "hash_ids": [2**64]}, "hash_ids must be a list of ints from 0 to "),
        ({**GOOD, "input_length": -1}, "input_length must be a whole number of tokens from 0 "),
        ({**GOOD, "output_length": 1.5}, "output_length must be a whole number of tokens"),
        ({**GOOD, "timestamp": -3}, "timestamp must be a number >= 0, got -3"),
        ({**GOOD, "timestamp": "noon"}, "timestamp must be a number >= 0, got a str"),
        ({**GOOD, "timestamp": False}, "timestamp must be a number >= 0, got a bool"),
        (
            {key: value for key, value in GOOD.items() if key != "hash_ids"},
            "no field 'hash_ids'; each line needs timestamp, input_length, output_length, hash_ids",
        ),
        ([1, 2], "expected a JSON object, got a list"),
    ],
)
def test_a_wrong_field_is_named_with_what_was_expected(
    tmp_path: pathlib.Path, record: object, expected: str
) -> None:
    path = trace_file(tmp_path, GOOD, record)
    assert refusal(path).startswith(f"{path}:2: {expected}")


def test_infinity_is_no_timestamp(tmp_path: pathlib.Path) -> None:
    line = '{"timestamp": Infinity, "input_length": 1, "output_length": 1, "hash_ids": []}'
    path = trace_file(tmp_path, line)
    assert refusal(path) == f"{path}:1: timestamp must be a number >= 0, got inf"


def test_a_huge_hash_ids_list_is_refused(tmp_path: pathlib.Path) -> None:
    path = trace_file(tmp_path, {**GOOD, "hash_ids": [7] * (MAX_BLOCKS_PER_REQUEST + 1)})
    assert refusal(path) == (
        f"{path}:1: hash_ids holds {MAX_BLOCKS_PER_REQUEST + 1} ids, more than the "
        f"{MAX_BLOCKS_PER_REQUEST} a request may (one id per block of the prompt)"
    )


def test_a_huge_line_is_refused_before_it_is_parsed(tmp_path: pathlib.Path) -> None:
    line = " " * MAX_LINE_BYTES + json.dumps(GOOD)
    path = trace_file(tmp_path, GOOD, line)
    assert refusal(path) == (
        f"{path}:2: the line holds {len(line)} bytes, more than the {MAX_LINE_BYTES} "
        "a line of a trace may"
    )


def test_an_empty_file_holds_no_requests(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    assert refusal(path) == f"{path}: no requests in the file; a trace has one a line"


def test_a_directory_and_a_device_are_refused_before_anything_is_read(
    tmp_path: pathlib.Path,
) -> None:
    assert refusal(tmp_path) == (
        f"{tmp_path}: it is a directory, not a regular file; a trace is a regular JSONL file"
    )
    assert refusal(pathlib.Path("/dev/zero")) == (
        "/dev/zero: it is a character device, not a regular file; a trace is a regular JSONL file"
    )


def test_a_missing_file_says_so(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "absent.jsonl"
    assert refusal(path) == f"{path}: cannot read it: No such file or directory"


def test_the_generated_trace_round_trips_through_the_jsonl_form(tmp_path: pathlib.Path) -> None:
    shape = TraceShape(requests=200, seed=5)
    written = io.StringIO()
    write_trace(generate_requests(shape), written)
    path = tmp_path / "generated.jsonl"
    path.write_text(written.getvalue())
    requests = read_trace(path)
    assert requests == generate_requests(shape)
    assert [list(request.block_hashes) for request in requests] == generate_trace(shape)


def test_the_mixed_shape_is_the_default_traffic() -> None:
    assert named_shape("mixed") == TraceShape(requests=6000)


def test_an_unknown_shape_is_refused_with_the_names_accepted() -> None:
    with pytest.raises(ValueError) as refused:
        named_shape("chat")
    assert str(refused.value) == (
        "no trace shape named 'chat'; expected one of mixed, conversation, agent, rag"
    )


def _used_once_share(trace: list[list[bytes]]) -> float:
    uses: dict[bytes, int] = {}
    for hashes in trace:
        for block in hashes:
            uses[block] = uses.get(block, 0) + 1
    return sum(1 for count in uses.values() if count == 1) / len(uses)


def test_the_shapes_differ_as_their_traffic_does() -> None:
    traces = {
        name: generate_trace(attrs.evolve(shape, requests=600)) for name, shape in SHAPES.items()
    }
    # Production conversations: most blocks are used once, prompts are long.
    assert _used_once_share(traces["conversation"]) > 0.6
    # An agent's loop reuses most of what it sends: few blocks used once.
    assert _used_once_share(traces["agent"]) < _used_once_share(traces["mixed"])
    mean_blocks = {name: sum(map(len, trace)) / len(trace) for name, trace in traces.items()}
    assert mean_blocks["conversation"] > 2 * mean_blocks["mixed"]
    # Retrieval: almost every prompt carries a document after its system prompt.
    assert mean_blocks["rag"] > mean_blocks["mixed"]
