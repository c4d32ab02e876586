"""How a deadline test waits: polling, up to a limit, so that a bug fails it instead of hanging."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

TEST_LIMIT_S = 30.0
"""What a test waits for at most before it fails instead of hanging."""

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str) -> T:
    """Poll ``condition`` until it answers something true, and return that answer."""
    deadline = time.monotonic() + TEST_LIMIT_S
    while not (answer := condition()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)
    return answer


def returns_within(seconds: float, action: Callable[[], T]) -> T:
    """What ``action`` returns, once it has returned in under ``seconds``."""
    started = time.monotonic()
    result = action()
    assert time.monotonic() - started < seconds
    return result
