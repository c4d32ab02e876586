"""The README's quick start runs as written, with the public import points only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PUBLIC_IMPORT_POINTS = {
    "kvwire",
    "kvwire.engine",
    "kvwire.media",
    "kvwire.testing",
    "kvwire.vllm",
    "kvwire.exceptions",
}


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


@pytest.mark.torch
def test_the_quick_start_builds_both_connectors_from_an_empty_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocks = [
        block
        for block in _python_blocks((REPO / "README.md").read_text())
        if "container_for_profile(" in block
    ]
    assert len(blocks) == 1
    # "..." stands for the application's own code.
    code = "\n".join(line for line in blocks[0].splitlines() if line.strip() != "...")
    # Not from the repository: the profile it names must come with kvwire itself.
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}

    exec(compile(code, "README.md quick start", "exec"), namespace)

    assert type(namespace["scheduler_connector"]).__name__ == "CPUOffloadConnector"
    assert type(namespace["worker_connector"]).__name__ == "CPUOffloadConnector"


def test_the_readme_and_docs_import_only_from_the_public_import_points() -> None:
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    imported = {
        (document.name, module)
        for document in documents
        for block in _python_blocks(document.read_text())
        for module in re.findall(r"^\s*from (kvwire[\w.]*) import", block, re.MULTILINE)
    }

    private = sorted(
        f"{name}: {module}" for name, module in imported if module not in PUBLIC_IMPORT_POINTS
    )
    assert private == []
    # The check reads the README's blocks at all (a renamed fence would pass it).
    assert "README.md" in {name for name, _ in imported}
