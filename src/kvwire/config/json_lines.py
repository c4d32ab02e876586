"""One line of a JSONL file a user names (a prompts file, a request trace): a JSON object.

Each refusal names the line (`where`, as `FILE:LINE`) and says what is
wrong without quoting the line's values: a line may be long, or hold text
the user would not want echoed.
"""

from __future__ import annotations

import json

from kvwire.common.redaction import kind_of, shown


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
