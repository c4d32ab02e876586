"""How a deadline test waits: polling, up to a limit, so that a bug fails it instead of hanging."""

from __future__ import annotations

import threading
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


def finishes_within(seconds: float, action: Callable[[], T]) -> T:
    """What ``action`` returns, run on a thread of its own, once it has returned within ``seconds``.

    Unlike :func:`returns_within`, an action that hangs fails the test at
    ``seconds`` instead of holding it: the thread is a daemon, left behind.
    """
    outcome: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(action())
        except BaseException as error:  # handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=run, name="finishes-within", daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"still running after {seconds:g} s"
    if errors:
        raise errors[0]
    return outcome[0]
