"""The README's `kvwire replay` commands, run as written, print the table the README shows."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
COMMAND = ".venv/bin/kvwire "


def readme_replay_section() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("## Sizing a CPU pool from your traffic")
    return readme[start : readme.index("\n## ", start + 1)]


def fenced(section: str, language: str) -> str:
    (block,) = re.findall(rf"^```{language}\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    return str(block)


@pytest.mark.slow
def test_the_readme_replay_commands_print_the_rows_it_shows(tmp_path: pathlib.Path) -> None:
    section = readme_replay_section()
    commands = fenced(section, "sh").splitlines()
    assert [line.startswith(COMMAND) for line in commands] == [True, True]
    outputs = []
    for command in commands:
        arguments = command.removeprefix(COMMAND).split()
        completed = subprocess.run(
            [sys.executable, "-m", "kvwire", *arguments],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert completed.returncode == 0, completed.stderr
        outputs.append(completed.stdout)
    printed = outputs[1].splitlines()
    for row in fenced(section, "text").splitlines():
        if row != "...":
            assert row in printed, row
    assert (tmp_path / "pool.png").stat().st_size > 0
