"""kvwire's log records in a vLLM process go through vLLM's logging configuration."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# Each case is a fresh interpreter: logging is process-wide state.
PROBE = """
import logging, sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
{before}
from kvwire.vllm.logs import follow_vllm_logging
print("followed" if follow_vllm_logging() else "left alone", flush=True)
logging.getLogger("kvwire.media.store.redis").info("an info line from kvwire")
logging.getLogger("kvwire.media.store.redis").warning("a warning from kvwire")
"""


def run_probe(before: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        env={**os.environ, "VLLM_LOGGING_COLOR": "0", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def lines_with(text: str, output: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


def test_kvwire_records_come_out_in_vllms_format_at_vllms_level() -> None:
    result = run_probe(VLLM_LOGGING_LEVEL="INFO")

    assert result.stdout.splitlines()[0] == "followed"
    (info,) = lines_with("an info line from kvwire", result.stdout)
    (warning,) = lines_with("a warning from kvwire", result.stdout)
    # vLLM's format: process and pid, level, time, [file:line], message.
    vllm_format = r"\(.* pid=\d+\) {} \d\d-\d\d \d\d:\d\d:\d\d \[.+:\d+\] "
    assert re.search(vllm_format.format("INFO"), info), info
    assert re.search(vllm_format.format("WARNING"), warning), warning
    # Printed once, by vLLM's handler: not a second time by Python's last resort.
    assert "a warning from kvwire" not in result.stderr


def test_vllms_logging_level_applies_to_kvwires_records() -> None:
    result = run_probe(VLLM_LOGGING_LEVEL="WARNING")

    assert lines_with("an info line from kvwire", result.stdout) == []
    assert len(lines_with("a warning from kvwire", result.stdout)) == 1


@pytest.mark.parametrize(
    ("before", "env"),
    [
        # vLLM told to configure no logging: kvwire's logger is not touched either.
        ("", {"VLLM_CONFIGURE_LOGGING": "0"}),
        # The application configured kvwire's logger itself, or the root logger.
        ("logging.getLogger('kvwire').addHandler(logging.StreamHandler(sys.stderr))", {}),
        ("logging.basicConfig(stream=sys.stderr)", {}),
    ],
)
def test_kvwires_logger_is_left_alone_where_vllm_or_the_application_says_so(
    before: str, env: dict[str, str]
) -> None:
    result = run_probe(before, **env)

    assert result.stdout.splitlines()[0] == "left alone"
    assert lines_with("a warning from kvwire", result.stdout) == []
