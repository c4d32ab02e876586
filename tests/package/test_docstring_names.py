"""Every kvwire name a docstring gives in backticks exists.

Docstrings name other objects fully qualified, in plain backticks
(`kvwire.ConnectorRegistry.resolve`), so that `help()` shows no link
markup; the documentation site links them (scripts/docs_links.py) where the
API reference renders them. A name that no longer exists (a moved module, a
renamed method) would silently stop being a link: this test finds it.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import griffe

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from docs_links import _NAME, linked  # noqa: E402


def docstring_names() -> dict[str, set[str]]:
    """Each backticked kvwire name of a docstring, with the modules whose docstrings give it."""
    names: dict[str, set[str]] = {}
    for path in sorted((REPO / "src" / "kvwire").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = [tree, *ast.walk(tree)]
        for node in nodes:
            if not isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                continue
            docstring = ast.get_docstring(node, clean=False) or ""
            for match in _NAME.finditer(docstring):
                names.setdefault(match[1], set()).add(str(path.relative_to(REPO)))
    return names


def names_in_strings() -> set[str]:
    """kvwire's string constants that are dotted names but no object: entry-point groups
    (`kvwire.eviction_policies`), which a docstring names too."""
    constants = set()
    for path in (REPO / "src" / "kvwire").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                constants.add(node.value)
    return constants


def test_every_backticked_kvwire_name_in_a_docstring_exists() -> None:
    package = griffe.load("kvwire", search_paths=[str(REPO / "src")], resolve_aliases=True)
    groups = names_in_strings()
    missing = []
    for name, where in sorted(docstring_names().items()):
        if name in groups:
            continue
        try:
            package[name.removeprefix("kvwire.")]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            missing.append(f"{name} (in {', '.join(sorted(where))})")
    assert missing == []


def test_the_names_are_found_at_all() -> None:
    names = docstring_names()
    assert "kvwire.ConnectorRegistry.resolve" in names
    assert len(names) > 100


def test_a_name_becomes_an_optional_link_and_a_link_title_stays_as_it_is() -> None:
    assert linked("see `kvwire.media.Medium`.") == (
        'see <autoref identifier="kvwire.media.Medium" optional>'
        "<code>kvwire.media.Medium</code></autoref>."
    )
    assert linked("[`kvwire.media`][kvwire.media] and `kvwire` and `other.name`") == (
        "[`kvwire.media`][kvwire.media] and `kvwire` and `other.name`"
    )


def test_help_of_the_package_shows_no_link_markup() -> None:
    shown = subprocess.run(
        [sys.executable, "-c", "import kvwire; help(kvwire)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={"PAGER": "cat", "TERM": "dumb", "PATH": "/usr/bin:/bin"},
    ).stdout
    assert "kvwire.ConnectorRegistry" in shown
    assert "][" not in shown
