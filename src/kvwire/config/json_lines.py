"""A JSONL file a user names (a prompts file, a request trace): its lines, each a JSON object.

The file is read bounded (`read_json_lines`); each refusal of a line names
it (`where`, as `FILE:LINE`) and says what is wrong without quoting the
line's values: a line may be long, or hold text the user would not want
echoed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from kvwire.common.redaction import kind_of, shown
from kvwire.config.bounded_file import FileRefused, read_regular_file, shown_path


def json_records(
    path: str | os.PathLike[str],
    *,
    max_bytes: int,
    max_lines: int,
    kind: str,
    items: str,
    record: str,
    max_line_bytes: int | None = None,
) -> Iterator[tuple[str, dict[str, object]]]:
    """Each line's JSON object of the regular file at `path`, with where it is (`FILE:LINE`).

    At most `max_bytes`, `max_lines` lines and, when given, `max_line_bytes`
    a line; blank lines are skipped. `kind` names the file in a refusal
    (`"trace"`), `items` what its lines hold (`"requests"`), `record` one
    line's object (`"a trace record"`). A `ValueError` names the file or the
    line.
    """
    where_file = shown_path(path)
    for number, raw in enumerate(_lines(path, max_bytes, max_lines, kind, items), start=1):
        where = f"{where_file}:{number}"
        if max_line_bytes is not None and len(raw) > max_line_bytes:
            raise ValueError(
                f"{where}: the line holds {len(raw)} bytes, more than the {max_line_bytes} "
                f"a line of a {kind} may"
            )
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{where}: not UTF-8 text ({error.reason})") from None
        if line.strip():
            yield where, parse_json_object(line, where, record)


def _lines(
    path: str | os.PathLike[str], max_bytes: int, max_lines: int, kind: str, items: str
) -> list[bytes]:
    where_file = shown_path(path)
    try:
        content = read_regular_file(path, max_bytes)
    except FileRefused as error:
        raise ValueError(f"{where_file}: {error}; a {kind} is a regular JSONL file") from None
    except OSError as error:
        raise ValueError(f"{where_file}: cannot read it: {error.strerror}") from None
    lines = content.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # what the last newline ends is no line
    if len(lines) > max_lines:
        raise ValueError(
            f"{where_file}: more than {max_lines} lines; a {kind} holds at most "
            f"{max_lines} {items}, one a line"
        )
    return lines


def parse_json_object(line: str, where: str, record: str) -> dict[str, object]:
    """The JSON object on `line`; `ValueError` prefixed `where` when it is not one.

    `record` names what a line holds (`"a prompt record"`), for the error
    about nesting too deep.
    """
    try:
        value = json.loads(line, object_pairs_hook=_refusing_duplicates)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deep to be {record}") from None
    except ValueError as error:
        # json's own refusals that are not decode errors (an integer of more
        # than Python's 4300 digits; a key given twice): the message names no value.
        raise ValueError(f"{where}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {kind_of(value)}")
    return value


def _refusing_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json keeps the last of two equal keys; the first would be silently ignored.
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(
                f"the field {shown(key)} appears twice in one object; give each field once"
            )
        seen.add(key)
    return dict(pairs)
