"""Calls into plug-in code a profile names: what it raises becomes an error naming the field.

A profile chooses plug-in code (a medium class through
``kv_connector_extra_config.medium``, a container hook); an exception from
it is a problem of the profile, not a crash of the engine, and its message
may quote what the plug-in was given (a URL and its password). So the error
raised instead names the field and the call, shows the plug-in's message
redacted and bounded (:mod:`kvwire.redaction`), and chains nothing: a
traceback printed later would quote the original message raw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvwire.config.extra_config import ExtraConfigError
from kvwire.exceptions import KVWireError
from kvwire.redaction import SHOWN_LENGTH, redact_text

_Result = TypeVar("_Result")

# A plug-in's own refusal (an ExtraConfigError naming its key) may say more
# than a stray exception's message shown beside the call.
LONGEST_REFUSAL = 1000


def plugin_message(error: BaseException, limit: int = SHOWN_LENGTH * 5) -> str:
    """``error``'s type and message, redacted, then cut to about ``limit`` characters."""
    text = redact_text(str(error))
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return f"{type(error).__name__}: {text}"


def call_plugin(field: str, what: str, call: Callable[[], _Result]) -> _Result:
    """``call()``; what it raises becomes an :class:`ExtraConfigError` naming ``field``, ``what``.

    ``what`` says which call failed (``"MyMedium.create_store"``). A
    kvwire error the plug-in raised on purpose (an :class:`ExtraConfigError`
    naming its key) is kept as it is when it shows no secret and is short,
    else shown redacted and bounded.
    """
    try:
        return call()
    except KVWireError as error:
        text = str(error)
        if len(text) <= LONGEST_REFUSAL and redact_text(text) == text:
            raise
        raise ExtraConfigError(
            f"{field}: {what} refused: {plugin_message(error, LONGEST_REFUSAL)}"
        ) from None
    except Exception as error:
        raise ExtraConfigError(f"{field}: {what} raised {plugin_message(error)}") from None
