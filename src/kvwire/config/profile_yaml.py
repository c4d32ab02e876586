"""Reading a profile's YAML text, bounded against hostile documents.

PyYAML's safe loader builds only plain values, but it still lets a small
document describe a huge one: aliases (`*name`) reuse a node, so nine
levels of nine aliases each expand to 387 million values in a few hundred
bytes (an "alias bomb"), and a recursive alias builds a structure that
contains itself. Anything that walks such a value (a check, an error
message, `json.dumps`) then takes minutes and gigabytes, or never ends.
This loader refuses a document whose expansion holds more than
`MAX_EXPANDED_NODES` values, a recursive alias, an integer with more
than `MAX_INTEGER_DIGITS` digits and nesting deeper than
`MAX_DEPTH` (directly or through aliases), and a mapping that
holds one key twice (PyYAML would keep the last silently), each with the
line and column at fault.

Error texts never quote the document: PyYAML's own messages include the
offending source line, which may hold a password.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from kvwire.common.redaction import shown_key
from kvwire.exceptions import ProfileYAMLError as ProfileYAMLError

# A real profile holds a few hundred values; ten thousand leaves room for
# long lists of composite children while keeping any walk instant.
MAX_EXPANDED_NODES = 10_000
# No setting needs more: 2**64 has 20 digits, a byte count in EiB 19.
MAX_INTEGER_DIGITS = 40
# A profile nests five or six levels; PyYAML's composer recurses per level.
MAX_DEPTH = 100


def parse_profile_text(text: str) -> Any:
    """The document in `text` (None when empty); raises
    `kvwire.exceptions.ProfileYAMLError`."""
    loader = _BoundedLoader(text)
    try:
        _check_nesting(text)
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as error:
        raise ProfileYAMLError(_describe(error)) from None
    except yaml.YAMLError as error:
        raise ProfileYAMLError(" ".join(str(error).split())[:200]) from None
    finally:
        loader.dispose()


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, refusing integers too long to be any setting."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = sum(character.isdigit() for character in str(node.value))
        if digits > MAX_INTEGER_DIGITS:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"an integer of {digits} digits; no setting takes more than {MAX_INTEGER_DIGITS}",
                node.start_mark,
            )
        value: int = super().construct_yaml_int(node)
        return value

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # PyYAML keeps the last of two equal keys; in a profile the first
        # would be silently ignored (a kv_role written twice, the first one
        # meant), so a mapping must hold each key once. Keys a merge (<<)
        # brings in may be overridden: that is what a merge is for.
        first_seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                earlier = first_seen.setdefault(key, key_node.start_mark)
            except TypeError:
                continue  # unhashable: the safe constructor refuses it with its own error
            if earlier is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {shown_key(key)} appears twice in one mapping (first at line "
                    f"{earlier.line + 1}); a mapping holds each key once",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _check_nesting(text: str) -> None:
    """Refuse nesting deeper than `MAX_DEPTH` from the event stream, before composing.

    PyYAML's parser keeps its own stack, but its composer recurses once per
    level: a few thousand brackets would end in a RecursionError.
    """
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                # The pure-Python parser's marks (the stubs also allow the C one's).
                mark = event.start_mark if isinstance(event.start_mark, yaml.Mark) else None
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_DEPTH} levels deep", mark
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand too far, refer to themselves, or nest too deep.

    Counts each node as often as aliases repeat it, without expanding
    anything: a node's expanded size is computed once and reused.
    """
    expanded: dict[int, int] = {}
    # Iterative depth-first walk: (node, depth, children done).
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    on_path: set[int] = set()
    while stack:
        node, depth, children_done = stack.pop()
        if children_done:
            on_path.discard(id(node))
            expanded[id(node)] = 1 + sum(expanded[id(child)] for child in _children(node))
            if expanded[id(node)] > MAX_EXPANDED_NODES:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"this node expands to more than {MAX_EXPANDED_NODES} values through its "
                    "aliases (*name); write the values out, or use fewer aliases",
                    node.start_mark,
                )
            continue
        if id(node) in expanded:
            continue
        if id(node) in on_path:
            raise yaml.composer.ComposerError(
                None,
                None,
                "an alias (*name) refers to a node that contains it; a profile cannot be recursive",
                node.start_mark,
            )
        if depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", node.start_mark
            )
        on_path.add(id(node))
        stack.append((node, depth, True))
        for child in _children(node):
            stack.append((child, depth + 1, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _describe(error: yaml.MarkedYAMLError) -> str:
    """PyYAML's error as a line and column with what was wrong, without the source line."""
    parts = []
    if error.problem_mark is not None:
        parts.append(f"line {error.problem_mark.line + 1}, column {error.problem_mark.column + 1}:")
    parts.append(_bounded(error.problem or "invalid document"))
    if error.context:
        where = ""
        if error.context_mark is not None:
            where = (
                f" at line {error.context_mark.line + 1}, column {error.context_mark.column + 1}"
            )
        parts.append(f"({_bounded(error.context)}{where})")
    return " ".join(parts)


def _bounded(text: str) -> str:
    # PyYAML's problem texts quote at most a token; keep them that short.
    text = _QUOTED_TOKEN.sub(_kept_or_elided, " ".join(text.split()))
    return text if len(text) <= 120 else f"{text[:120]}..."


# A token PyYAML quotes in a problem: an alias or anchor name, a tag, a
# character. An alias name may be a password typed after '*'.
_QUOTED_TOKEN = re.compile(r"'([^']*)'")


def _kept_or_elided(match: re.Match[str]) -> str:
    token = match.group(1)
    # One character ('\t'), a token kind ('<stream end>'), or one of the
    # unsafe Python tags the safe loader refuses: nothing a user chose.
    kept = (
        len(token) <= 2
        or (token.startswith("<") and token.endswith(">"))
        or token.startswith("tag:yaml.org,2002:python/")
    )
    return match.group(0) if kept else "(name not shown)"
