"""A transfer handler's close, in steps that each run even when one before them failed.

A stuck save must not keep the thread pools from stopping, nor a medium
from closing its store: each step's failure is logged, and the next runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

__all__ = ["close_in_steps"]


def close_in_steps(
    logger: logging.Logger, label: str, steps: Sequence[tuple[str, Callable[[], object]]]
) -> None:
    """Run each `(what, step)` in order; one that raises is logged as `label` + what failed."""
    for what, step in steps:
        try:
            step()
        except Exception:
            logger.exception("%sshutdown: %s failed", label, what)
