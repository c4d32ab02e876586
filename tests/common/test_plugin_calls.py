"""Plug-in code that exits or interrupts: its own error, unless the user pressed Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator

import pytest

from kvwire.common.plugin_calls import PluginExit, call_plugin, contained_exits, plugin_message
from kvwire.config.extra_config import ExtraConfigError


@pytest.mark.parametrize(
    "raised", [SystemExit(3), KeyboardInterrupt("gave up"), GeneratorExit("closed")]
)
def test_what_plug_in_code_raises_that_is_no_exception_becomes_its_error(
    raised: BaseException,
) -> None:
    # Caught as BaseException: one that escaped would otherwise stop the test session.
    try:
        with contained_exits():
            raise raised
    except BaseException as error:
        caught = error

    assert isinstance(caught, PluginExit), repr(caught)
    assert caught.original is raised
    assert plugin_message(caught) == f"{type(raised).__name__}: {raised}"
    # Nothing chained: a traceback printed later would show the plug-in's message raw.
    assert caught.__suppress_context__


@pytest.fixture
def python_sigint_handler() -> Iterator[None]:
    """Python's own SIGINT handler in place, as in a program started from a terminal.

    A suite started in the background (`cmd &`, nohup) inherits SIGINT ignored.
    """
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, inherited)


@pytest.mark.usefixtures("python_sigint_handler")
def test_a_ctrl_c_during_plug_in_code_still_interrupts() -> None:
    with pytest.raises(KeyboardInterrupt), contained_exits():
        signal.raise_signal(signal.SIGINT)


@pytest.mark.usefixtures("python_sigint_handler")
def test_the_sigint_handler_in_place_is_back_after_the_call() -> None:
    before = signal.getsignal(signal.SIGINT)
    with contained_exits():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


def test_a_process_that_ignores_sigint_keeps_ignoring_it_during_plug_in_code() -> None:
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with contained_exits():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)  # ignored: nothing raised
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_off_the_main_thread_a_keyboard_interrupt_is_the_plug_ins() -> None:
    caught: list[BaseException] = []

    def call() -> None:
        try:
            with contained_exits():
                raise KeyboardInterrupt
        except BaseException as error:
            caught.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert [type(error) for error in caught] == [PluginExit]


def test_an_ordinary_exception_passes_unchanged() -> None:
    error = RuntimeError("plain")
    with pytest.raises(RuntimeError) as caught, contained_exits():
        raise error
    assert caught.value is error


def test_a_plug_in_hook_that_calls_sys_exit_is_an_error_naming_its_field_redacted() -> None:
    def create_store() -> None:
        sys.exit("cannot reach redis://u:hunter2-secret@h")

    with pytest.raises(ExtraConfigError) as caught:
        call_plugin("kv_connector_extra_config.medium", "MyMedium.create_store", create_store)

    assert str(caught.value) == (
        "kv_connector_extra_config.medium: MyMedium.create_store raised SystemExit: cannot "
        "reach redis://u:***@h"
    )


def test_what_the_sigint_handler_in_place_raises_is_not_taken_for_the_plug_ins() -> None:
    def engine_handler(signum: int, frame: object) -> None:
        raise SystemExit("the engine shuts down")

    previous = signal.signal(signal.SIGINT, engine_handler)
    try:
        try:
            with contained_exits():
                signal.raise_signal(signal.SIGINT)
        except BaseException as error:
            caught = error
    finally:
        signal.signal(signal.SIGINT, previous)

    assert type(caught) is SystemExit
