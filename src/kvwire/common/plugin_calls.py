"""Calls into plug-in code a profile names: what it raises becomes an error naming the field.

A profile chooses plug-in code (a medium class through
`kv_connector_extra_config.medium`, a container hook); an exception from
it is a problem of the profile, not a crash of the engine, and its message
may quote what the plug-in was given (a URL and its password). So the error
raised instead names the field and the call, shows the plug-in's message
redacted and bounded (`kvwire.common.redaction`), and chains nothing: a
traceback printed later would quote the original message raw.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

from kvwire.common.redaction import SHOWN_LENGTH, redact_text
from kvwire.config.extra_config import ExtraConfigError
from kvwire.exceptions import KVWireError
from kvwire.exceptions import PluginExit as PluginExit

_Result = TypeVar("_Result")

# A plug-in's own refusal (an ExtraConfigError naming its key) may say more
# than a stray exception's message shown beside the call.
LONGEST_REFUSAL = 1000


@contextlib.contextmanager
def contained_exits() -> Iterator[None]:
    """Around a call into plug-in code: a `BaseException` it raises becomes
    `kvwire.exceptions.PluginExit`.

    Except what the user's Ctrl-C caused (Python's `KeyboardInterrupt`,
    or whatever the SIGINT handler in place raises): it stops the program
    as it always does. The two are told apart by the signal: on the main
    thread, a SIGINT that arrives during the call is noted before the
    handler that was in place runs; a `KeyboardInterrupt` with no SIGINT
    behind it was raised by the plug-in. (Off the main thread no signal is
    delivered, so any is the plug-in's.) Other signals' handlers are not
    told apart: a `SystemExit` one raises during the call is taken for
    the plug-in's.
    """
    sigint = _SigintNoted()
    try:
        yield
    except Exception:
        raise
    except BaseException as error:
        if sigint.arrived:
            # Whatever the SIGINT handler in place raised (KeyboardInterrupt,
            # or an engine's own handler's SystemExit): the user's, not the plug-in's.
            raise
        raise PluginExit(error) from None
    finally:
        sigint.stop()


class _SigintNoted:
    """Notes a SIGINT while installed, then hands it to the handler it replaced."""

    def __init__(self) -> None:
        self.arrived = False
        self._previous: Callable[[int, FrameType | None], object] | None = None
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):
            return  # ignored, or the default: no KeyboardInterrupt can come of a SIGINT
        self._previous = previous
        signal.signal(signal.SIGINT, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> object:
        self.arrived = True
        if self._previous is None:
            raise KeyboardInterrupt
        return self._previous(signum, frame)

    def stop(self) -> None:
        # Restored only if still ours: plug-in code may have installed its own.
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._note:
            signal.signal(signal.SIGINT, self._previous)


def plugin_message(error: BaseException, limit: int = SHOWN_LENGTH * 5) -> str:
    """`error`'s type and message, redacted, then cut to about `limit` characters.

    A `kvwire.exceptions.PluginExit` is shown as what the plug-in raised
    (`SystemExit: 3`).
    """
    if isinstance(error, PluginExit):
        error = error.original
    text = redact_text(str(error))
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return f"{type(error).__name__}: {text}"


def call_plugin(field: str, what: str, call: Callable[[], _Result]) -> _Result:
    """`call()`; what it raises becomes an `kvwire.exceptions.ExtraConfigError`
    naming `field`, `what`.

    `what` says which call failed (`"MyMedium.create_store"`). A
    kvwire error the plug-in raised on purpose (an
    `kvwire.exceptions.ExtraConfigError` naming its key) is kept as it is when
    it shows no secret and is short, else shown redacted and bounded.
    """
    try:
        with contained_exits():
            return call()
    except PluginExit as error:
        raise ExtraConfigError(f"{field}: {what} raised {plugin_message(error)}") from None
    except KVWireError as error:
        text = str(error)
        if len(text) <= LONGEST_REFUSAL and redact_text(text) == text:
            raise
        raise ExtraConfigError(
            f"{field}: {what} refused: {plugin_message(error, LONGEST_REFUSAL)}"
        ) from None
    except Exception as error:
        raise ExtraConfigError(f"{field}: {what} raised {plugin_message(error)}") from None
