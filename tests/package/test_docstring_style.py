"""kvwire's docstrings and comments are Markdown, the style the documentation site renders.

The API reference renders docstrings with mkdocstrings as Markdown: a cross-reference is
``[`Name`][kvwire.path.Name]`` (or a plain code span for what the site does not show), a literal
is one backtick, a code example a fenced block. reStructuredText written there shows raw on the
site, so none may come back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvwire

SOURCE_ROOT = Path(kvwire.__file__).parent
REST_ROLE = re.compile(r":(?:py:)?(?:class|meth|mod|func|attr|data|exc|obj|const|ref|doc):`")
REST_LITERAL_BLOCK = re.compile(r"\S::$", re.MULTILINE)


def _sources() -> list[Path]:
    return sorted(SOURCE_ROOT.rglob("*.py"))


def _docstrings(path: Path) -> list[tuple[int, str]]:
    """Every string statement in the module (module, class, function and attribute docstrings)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (node.lineno, node.value.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]


def test_the_sources_are_found() -> None:
    assert len(_sources()) > 100


def test_no_restructuredtext_role_appears_in_the_sources() -> None:
    found = [
        f"{path.relative_to(SOURCE_ROOT)}:{number}: {line.strip()}"
        for path in _sources()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if REST_ROLE.search(line)
    ]

    assert found == [], "reST roles; write [`Name`][kvwire.path.Name] or `Name`:\n" + "\n".join(
        found
    )


def test_no_docstring_has_a_double_backtick_literal_or_a_literal_block() -> None:
    found = [
        f"{path.relative_to(SOURCE_ROOT)}:{number}"
        for path in _sources()
        for number, text in _docstrings(path)
        if "``" in text.replace("```", "") or REST_LITERAL_BLOCK.search(text)
    ]

    assert found == [], (
        "``literal`` or `::` block; write `literal` or a fenced block:\n" + "\n".join(found)
    )
