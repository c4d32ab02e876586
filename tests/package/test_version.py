"""kvwire's version is written once, in pyproject.toml, and read from the installed metadata."""

from __future__ import annotations

import pathlib
import re

import kvwire

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_package_version_is_pyprojects() -> None:
    declared = re.search(r'^version = "([^"]+)"$', PYPROJECT.read_text(), re.MULTILINE)
    assert declared is not None
    assert kvwire.__version__ == declared.group(1)
