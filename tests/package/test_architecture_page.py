"""The architecture page's layout table names every module of `src/kvwire/`, and nothing else.

Each row of the table is one package (`kvwire/media/`) or top-level module
(`kvwire/cli/__init__.py`) of the tree, in the tree's order. A package's row names each
of its modules by file name (`jobs.py`), first in the tree's order; its
`__init__.py` is the row itself. Every path the page names exists, so a moved
or removed module cannot stay on the page: one that starts at `kvwire/` is
read as it is, any other within the row's folder (outside the table: `kvwire/`).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PAGE = REPO / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(kvwire/[^`]*)` \| (.*) \|$")
CODE_SPAN = re.compile(r"`([^`]+)`")
# A code span that is a path: a module file or a folder, nothing else (no spaces, no URL).
PATH_SPAN = re.compile(r"^[\w./]*(?:\.py|/)$")


def _rows(text: str) -> list[tuple[str, str]]:
    """The layout table's rows: where (a path under `src/`), what."""
    return [
        (match[1], match[2]) for line in text.splitlines() if (match := ROW.match(line)) is not None
    ]


def _folder(where: str) -> PurePosixPath:
    """The folder a row's own paths are relative to: the package, or a module's parent."""
    path = PurePosixPath(where)
    return path if where.endswith("/") else path.parent


def _resolve(folder: PurePosixPath, path: str) -> str:
    """A named path under `src/`: one starting at `kvwire/` as it is, any other within `folder`."""
    path = path.removeprefix("src/")
    return str(PurePosixPath(path) if path.startswith("kvwire/") else folder / path)


def _paths(text: str) -> list[str]:
    return [span for span in CODE_SPAN.findall(text) if PATH_SPAN.match(span)]


def _modules() -> list[PurePosixPath]:
    return sorted(
        PurePosixPath(path.relative_to(SRC).as_posix()) for path in (SRC / "kvwire").rglob("*.py")
    )


def missing_modules(rows: list[tuple[str, str]]) -> list[str]:
    """Each module of the tree that the table does not name in its row."""
    own_rows = {where for where, _ in rows}
    named = {(str(_folder(where)), path) for where, what in rows for path in _paths(what)}
    missing = []
    for module in _modules():
        package = str(module.parent)
        if module.parent == PurePosixPath("kvwire"):
            found = str(module) in own_rows
        elif module.name == "__init__.py":
            found = f"{package}/" in own_rows
        else:
            found = f"{package}/" in own_rows and (package, module.name) in named
        if not found:
            missing.append(str(module))
    return missing


def named_paths_missing(text: str) -> list[str]:
    """Each path the page names that is not in the tree."""
    rows = _rows(text)
    named = [where for where, _ in rows]
    named += [_resolve(_folder(where), path) for where, what in rows for path in _paths(what)]
    prose = "\n".join(line for line in text.splitlines() if ROW.match(line) is None)
    named += [_resolve(PurePosixPath("kvwire"), path) for path in _paths(prose)]
    return sorted({path for path in named if not (SRC / path).exists()})


def _tree_order(where: str) -> tuple[str, ...]:
    return PurePosixPath(where).parts


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def test_the_table_names_every_module_of_the_tree_in_its_row(page: str) -> None:
    assert missing_modules(_rows(page)) == []


def test_every_path_the_page_names_exists(page: str) -> None:
    assert named_paths_missing(page) == []


def test_the_rows_are_in_the_trees_order(page: str) -> None:
    wheres = [where for where, _ in _rows(page)]

    assert wheres == sorted(wheres, key=_tree_order)


def test_each_rows_modules_come_first_in_the_trees_order(page: str) -> None:
    out_of_order = []
    for where, what in _rows(page):
        modules = list(dict.fromkeys(path for path in _paths(what) if path.endswith(".py")))
        if modules != sorted(modules):
            out_of_order.append(f"{where}: {', '.join(modules)}")

    assert out_of_order == []


def test_a_module_left_out_or_named_in_another_row_is_found(page: str) -> None:
    rows = _rows(page)
    media = next(index for index, (where, _) in enumerate(rows) if where == "kvwire/media/")
    where, what = rows[media]
    rows[media] = (where, what.replace("`jobs.py`", "`jobs`"))
    cpu_pool = next(index for index, (where, _) in enumerate(rows) if where.endswith("cpu_pool/"))
    rows[cpu_pool] = (rows[cpu_pool][0], rows[cpu_pool][1] + "; `jobs.py`")

    assert missing_modules(rows) == ["kvwire/media/jobs.py"]
    assert named_paths_missing(page + "\n| `kvwire/media/cpu_pool/` | `jobs.py` |\n") == [
        "kvwire/media/cpu_pool/jobs.py"
    ]


def test_a_path_named_outside_the_table_that_is_not_in_the_tree_is_found(page: str) -> None:
    assert named_paths_missing(page + "\nSee `media/store/_gone.py` and `kvwire/gone/`.\n") == [
        "kvwire/gone",
        "kvwire/media/store/_gone.py",
    ]
