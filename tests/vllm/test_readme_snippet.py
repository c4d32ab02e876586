"""The README's vLLM snippet, run as a user runs it: a script of its own, from an empty folder,
vLLM's default multi-process engine (spawn), the profile by name."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The one line the test changes: the model, to the tiny one built here (nothing is downloaded).
MODEL_LINE = re.compile(r"^model = .*$", re.MULTILINE)


def readme_vllm_snippet() -> str:
    blocks = re.findall(
        r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.MULTILINE | re.DOTALL
    )
    snippets = [block for block in blocks if "from vllm import LLM" in block]
    assert len(snippets) == 1
    return snippets[0]


def test_the_readme_snippet_names_a_profile_by_name_under_the_main_guard() -> None:
    snippet = readme_vllm_snippet()

    assert '"kvwire_profile": "cpu-offload"' in snippet
    assert 'if __name__ == "__main__":' in snippet
    assert len(MODEL_LINE.findall(snippet)) == 1


@pytest.mark.slow
def test_the_readme_snippet_generates_as_written_from_an_empty_folder(
    tiny_model: str, tmp_path: pathlib.Path
) -> None:
    script = tmp_path / "serve.py"
    script.write_text(MODEL_LINE.sub(f"model = {tiny_model!r}", readme_vllm_snippet()))
    folder = tmp_path / "empty"
    folder.mkdir()
    # vLLM's default: the engine core in a process of its own, started with spawn (this
    # suite's in-process setting is the tests' own, not a user's).
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["VLLM_LOGGING_LEVEL"] = "INFO"

    completed = subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert completed.returncode == 0, completed.stderr[-4000:]
    # What it printed: the generated text, words of the tiny model's vocabulary.
    assert completed.stdout.strip(), completed.stderr[-4000:]
    log = completed.stderr + completed.stdout
    assert "kvwire scheduler connector: CPUOffloadConnector" in log
    assert "profile 'cpu-offload'" in log
    assert "bootstrapping phase" not in log
    # The HMA gate's decision, once for each role's connector.
    assert log.count("HMA gate: ") == 2, log[-4000:]
