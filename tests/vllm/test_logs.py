"""kvwire's log records in a vLLM process go through vLLM's logging configuration."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import attrs
import pytest

# Logging is process-wide state, so each case runs in a process of its own: a
# child forked from one interpreter that imported vLLM's logging once (the
# import of ``vllm.config`` takes seconds; nothing in it configures logging).
# The child takes its case's environment, then does what the case says.
PROBE = '''
import json, os, sys, traceback
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
import kvwire.vllm.logs

CASE = """
import logging, sys
configure_logging(LoggingConfig())
{before}
from kvwire.vllm.logs import follow_vllm_logging
print("followed" if follow_vllm_logging() else "left alone", flush=True)
logging.getLogger("kvwire.media.store.redis").info("an info line from kvwire")
logging.getLogger("kvwire.media.store.redis").warning("a warning from kvwire")
"""
for case in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        os.environ.update(case["env"])
        for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        code = 0
        try:
            exec(CASE.format(before=case["before"]), dict(globals()))
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the child never goes on to the next case
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the case {case} failed: see {case['stderr']}")
'''

CASES: dict[str, tuple[str, dict[str, str]]] = {
    "info": ("", {"VLLM_LOGGING_LEVEL": "INFO"}),
    "warning": ("", {"VLLM_LOGGING_LEVEL": "WARNING"}),
    # vLLM told to configure no logging: kvwire's logger is not touched either.
    "vllm-configures-none": ("", {"VLLM_CONFIGURE_LOGGING": "0"}),
    # The application configured kvwire's logger itself, or the root logger.
    "kvwire-handler": (
        "logging.getLogger('kvwire').addHandler(logging.StreamHandler(sys.stderr))",
        {},
    ),
    "root-handler": ("logging.basicConfig(stream=sys.stderr)", {}),
}


@attrs.frozen
class Output:
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Output]:
    """Each case's output, from one probe process that forks a child per case."""
    folder = tmp_path_factory.mktemp("log-probes")
    cases = [
        {
            "before": before,
            "env": env,
            "stdout": str(folder / f"{name}.out"),
            "stderr": str(folder / f"{name}.err"),
        }
        for name, (before, env) in CASES.items()
    ]
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cases)],
        env={**os.environ, "VLLM_LOGGING_COLOR": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    return {
        name: Output((folder / f"{name}.out").read_text(), (folder / f"{name}.err").read_text())
        for name in CASES
    }


def lines_with(text: str, output: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


def test_kvwire_records_come_out_in_vllms_format_at_vllms_level(
    outputs: dict[str, Output],
) -> None:
    result = outputs["info"]

    assert result.stdout.splitlines()[0] == "followed"
    (info,) = lines_with("an info line from kvwire", result.stdout)
    (warning,) = lines_with("a warning from kvwire", result.stdout)
    # vLLM's format: process and pid, level, time, [file:line], message.
    vllm_format = r"\(.* pid=\d+\) {} \d\d-\d\d \d\d:\d\d:\d\d \[.+:\d+\] "
    assert re.search(vllm_format.format("INFO"), info), info
    assert re.search(vllm_format.format("WARNING"), warning), warning
    # Printed once, by vLLM's handler: not a second time by Python's last resort.
    assert "a warning from kvwire" not in result.stderr


def test_vllms_logging_level_applies_to_kvwires_records(outputs: dict[str, Output]) -> None:
    result = outputs["warning"]

    assert lines_with("an info line from kvwire", result.stdout) == []
    assert len(lines_with("a warning from kvwire", result.stdout)) == 1


@pytest.mark.parametrize("case", ["vllm-configures-none", "kvwire-handler", "root-handler"])
def test_kvwires_logger_is_left_alone_where_vllm_or_the_application_says_so(
    case: str, outputs: dict[str, Output]
) -> None:
    result = outputs[case]

    assert result.stdout.splitlines()[0] == "left alone"
    assert lines_with("a warning from kvwire", result.stdout) == []
