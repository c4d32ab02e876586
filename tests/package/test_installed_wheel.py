"""What a user installs: the wheel built from this tree, in a fresh venv outside the repository,
torch from the pin first as the README says, its commands run from an empty folder."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

import pytest

# Building and installing take seconds (torch comes from the pin's local wheel).
pytestmark = [pytest.mark.slow, pytest.mark.torch]

REPO = pathlib.Path(__file__).resolve().parents[2]
# What the wheel is built from: the package and the files pyproject.toml names.
SOURCES = ("src", "pyproject.toml", "README.md", "LICENSE")
INSTALL_TIMEOUT_S = 240


def readme_profile_name() -> str:
    """The profile the README's vLLM line names."""
    names = re.findall(r'"kvwire_profile": "([^"]+)"', (REPO / "README.md").read_text())
    assert len(set(names)) == 1, names
    return names[0]


def declared_version() -> str:
    declared = re.search(
        r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE
    )
    assert declared is not None
    return declared.group(1)


def run(command: Sequence[str | os.PathLike[str]], cwd: pathlib.Path) -> str:
    # Nothing of this process's environment points the venv back at the repository.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    completed = subprocess.run(
        [os.fspath(part) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    assert completed.returncode == 0, (
        f"{' '.join(map(os.fspath, command))} exited {completed.returncode}:\n"
        f"{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    )
    return completed.stdout


def build_isolation() -> list[str]:
    """No build isolation where this venv's setuptools can build the wheel: nothing fetched."""
    requires = re.search(
        r'requires = \["setuptools>=(\d+)"\]', (REPO / "pyproject.toml").read_text()
    )
    assert requires is not None
    try:
        installed = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if installed >= int(requires.group(1)) else []


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A fresh venv with the wheel and its torch extra installed; its bin folder."""
    root = tmp_path_factory.mktemp("installed-wheel")
    # A copy of the sources: the build leaves nothing in the repository (build/, egg-info).
    source = root / "source"
    source.mkdir()
    for name in SOURCES:
        origin = REPO / name
        if origin.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(origin, source / name, ignore=ignore)
        else:
            shutil.copy2(origin, source / name)
    wheels = root / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *build_isolation(), "-w", wheels,
         source], cwd=root)  # fmt: skip
    (wheel,) = wheels.glob("kvwire-*.whl")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=root)
    python = venv / "bin" / "python"
    constraints = REPO / "constraints.txt"
    # No bytecode compiled at install (18 of torch's 25 s here): the few commands
    # this venv runs compile what they import for themselves.
    install = [python, "-m", "pip", "install", "-q", "--no-compile", "-c", constraints]
    run([*install, "torch==2.13.0"], cwd=root)
    run([*install, f"{wheel}[torch]"], cwd=root)
    return venv / "bin"


@pytest.fixture
def empty_folder(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_kvwire_is_imported_from_the_venv_not_the_repository(
    installed: pathlib.Path, empty_folder: pathlib.Path
) -> None:
    location = run(
        [installed / "python", "-c", "import kvwire; print(kvwire.__file__)"], empty_folder
    )

    assert pathlib.Path(location.strip()).is_relative_to(installed.parent)


def test_version_is_the_declared_one(installed: pathlib.Path, empty_folder: pathlib.Path) -> None:
    assert run([installed / "kvwire", "--version"], empty_folder) == (
        f"kvwire {declared_version()}\n"
    )


def test_the_wheel_ships_every_profile_of_containers_and_resolves_each_by_name(
    installed: pathlib.Path, empty_folder: pathlib.Path
) -> None:
    listed = run([installed / "kvwire", "profiles"], empty_folder).splitlines()
    shipped = sorted(path.stem for path in (REPO / "containers").glob("*.yaml"))

    assert shipped
    assert [line.split()[0] for line in listed[1 : 1 + len(shipped)]] == shipped
    assert listed[1 + len(shipped)] == ""
    for name in shipped:
        shown = run([installed / "kvwire", "profiles", "--show", name], empty_folder)
        assert shown == (REPO / "containers" / f"{name}.yaml").read_text()
    # Read from the installed package, not from this repository.
    folder = listed[-1].removeprefix("files: ").split(";")[0]
    assert pathlib.Path(folder).resolve().is_relative_to(installed.parent.resolve())


def test_the_installed_metadata_names_its_license_and_where_the_project_lives(
    installed: pathlib.Path, empty_folder: pathlib.Path
) -> None:
    probe = (
        "import importlib.metadata as m, pathlib\n"
        "meta = m.metadata('kvwire')\n"
        "print(meta['License-Expression'])\n"
        "print(sorted(url.split(',')[0] for url in meta.get_all('Project-URL')))\n"
        "license = [f for f in m.files('kvwire') if f.name == 'LICENSE']\n"
        "print(pathlib.Path(license[0].locate()).read_text().split()[:3])\n"
    )

    assert run([installed / "python", "-c", probe], empty_folder).splitlines() == [
        "Apache-2.0",
        "['Changelog', 'Documentation', 'Issues', 'Source']",
        "['Apache', 'License', 'Version']",
    ]


def test_check_of_the_readmes_profile_name_passes(
    installed: pathlib.Path, empty_folder: pathlib.Path
) -> None:
    name = readme_profile_name()

    lines = run([installed / "kvwire", "check", name], empty_folder).splitlines()

    assert lines[0] == f"profile {name}: valid"
    assert lines[1].startswith("connector: CPUOffloadConnector -> ")
    assert lines[-1] == "ok"


def test_run_of_the_default_profile_says_what_the_connector_bought(
    installed: pathlib.Path, empty_folder: pathlib.Path
) -> None:
    out = run([installed / "kvwire", "run", "--no-progress"], empty_folder)

    lines = out.splitlines()
    assert lines[0] == "kvwire run: CPUOffloadConnector (inline worker)"
    assert re.search(r"^tokens from connector +0 +0 +[1-9][\d,]* +0$", out, re.MULTILINE)
    assert re.search(r"^outputs identical +yes +yes +yes +yes$", out, re.MULTILINE)
    assert lines[-1].startswith("With CPUOffloadConnector the warm pass took ")
    assert lines[-1].endswith("every output was identical to the no-connector pass.")
