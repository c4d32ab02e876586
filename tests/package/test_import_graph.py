"""kvwire's import graph: `kvwire.exceptions` is a leaf, and no modules import each other in a loop.

The graph is read from the source (no kvwire module is imported): every
`import` statement counts, including those under `TYPE_CHECKING` and inside
functions, since a cycle through them still ties the modules' designs together
and becomes an import-time failure as soon as one of them moves to the top.
Importing `a.b.c` counts as depending on `a.b.c` only: the packages above it
run first but are not part of what the importing module asked for.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "src"


def _modules() -> dict[str, Path]:
    """Every module of src/kvwire by dotted name; a package by its own name."""
    modules = {}
    for path in sorted((SOURCE / "kvwire").rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(name: str, path: Path) -> Iterator[str]:
    """The absolute dotted names an import statement anywhere in the module asks for."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from package import submodule` asks for the submodule.
            yield from (f"{source}.{alias.name}" for alias in node.names)


def _kvwire_module_of(dotted: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `dotted` that is a kvwire module, or None for anything else."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def import_graph() -> dict[str, set[str]]:
    """Each kvwire module and the kvwire modules it imports (itself left out)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {_kvwire_module_of(dotted, modules) for dotted in _imported_names(name, path)}
        graph[name] = {target for target in targets if target is not None and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = lowlink[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_loop_and_only_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}

    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_counts_type_checking_and_function_level_imports() -> None:
    graph = import_graph()

    # kvwire.vllm.plugin imports the startup check inside a function only.
    assert "kvwire.vllm.startup_check" in graph["kvwire.vllm.plugin"]
    # kvwire's package re-exports lazily: its imports are under TYPE_CHECKING.
    assert "kvwire.container" in graph["kvwire"]


def test_kvwire_exceptions_imports_nothing_of_kvwire() -> None:
    path = _modules()["kvwire.exceptions"]

    imported = sorted(
        dotted
        for dotted in _imported_names("kvwire.exceptions", path)
        if dotted.split(".")[0] == "kvwire"
    )

    assert imported == []


def test_no_kvwire_modules_import_each_other_in_a_loop() -> None:
    found = cycles(import_graph())

    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in found)


def test_importing_kvwire_exceptions_loads_no_other_kvwire_module_nor_torch_nor_redis() -> None:
    # What `import kvwire` loads is the floor for any kvwire module; the errors add only themselves.
    probe = (
        "import sys, kvwire\n"
        "before = set(sys.modules)\n"
        "import kvwire.exceptions\n"
        "added = {m for m in set(sys.modules) - before if m.split('.')[0] == 'kvwire'}\n"
        "heavy = {'torch', 'redis', 'vllm'} & set(sys.modules)\n"
        "print(sorted(added | heavy))\n"
    )

    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )

    assert result.stdout.strip() == "['kvwire.exceptions']"


def test_importing_kvwire_s_vllm_plugin_loads_only_the_plugin_and_the_connectors_names() -> None:
    # vLLM imports the plugin in every process it starts, kvwire connector or
    # not (tests/vllm/test_plugin_imports.py calls it there); vLLM itself is
    # imported only when the plugin is called.
    probe = (
        "import sys, kvwire.vllm.plugin\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kvwire', 'vllm', 'torch')))\n"
    )

    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )

    assert result.stdout.strip() == str(
        [
            "kvwire",
            "kvwire.common",
            "kvwire.common.lazy_exports",
            "kvwire.vllm",
            "kvwire.vllm.connector_names",
            "kvwire.vllm.plugin",
        ]
    )


def test_no_connector_or_medium_looks_a_registry_up() -> None:
    # The container enters the registry once per build and hands a connector
    # its medium and a medium its plug-in classes; a connector or medium that
    # imported the registry would bypass a container's overrides.
    graph = import_graph()
    built = [name for name in graph if name.startswith(("kvwire.connectors", "kvwire.media"))]
    looking_up = sorted(
        f"{name} -> {imported}"
        for name in built
        for imported in graph[name]
        if imported == "kvwire.registry" or imported.startswith("kvwire.registry.")
    )

    assert looking_up == []
