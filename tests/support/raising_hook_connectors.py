"""Connectors whose class hooks fail as a plug-in's can: each named after how.

Their messages quote a secret; ``kvwire check``, ``kvwire run`` and the
engine must name the hook and show the message redacted, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kvwire.testing import IdleConnector

LEAKY_MESSAGE = "lost redis://u:hunter2-secret@h"


class RaisingHMAHookConnector(IdleConnector):
    """Its ``supports_hma_for_config`` raises a RuntimeError."""

    @classmethod
    def supports_hma_for_config(cls, config: Any, resolve: Callable[[Any], bool]) -> bool:
        raise RuntimeError(LEAKY_MESSAGE)


class ExitingHMAHookConnector(IdleConnector):
    """Its ``supports_hma_for_config`` calls ``sys.exit()``."""

    @classmethod
    def supports_hma_for_config(cls, config: Any, resolve: Callable[[Any], bool]) -> bool:
        sys.exit(LEAKY_MESSAGE)


class ExitingValidationConnector(IdleConnector):
    """Its ``validate_extra_config`` calls ``sys.exit()``."""

    @classmethod
    def validate_extra_config(cls, config: Any, resolve: Callable[[Any], Any]) -> None:
        sys.exit(LEAKY_MESSAGE)


class ExitingConstructorConnector(IdleConnector):
    """Its constructor calls ``sys.exit()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        sys.exit(LEAKY_MESSAGE)
