"""Plug-in stores that answer wrongly: never a wrong block loaded, never a crash.

A store that reports fewer results than keys, answers one key twice, names
no key of the call, or counts a prefix it cannot hold, runs the engine with
the outputs it would have without a connector: the blocks in question are
load errors or misses, with a rate-limited warning naming the medium.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest

from kvwire.cli import check_profile
from kvwire.config import EngineConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.engine.engine import LLMEngine, RequestOutput
from kvwire.media.store.medium import StoreMedium
from tests.support.engines import (
    generate,
    served,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.stores import DictStore


class HonestStore(DictStore):
    """Entries in a dict of this module's own, answered truthfully; subclasses lie."""

    entries: ClassVar[dict[str, bytes]] = {}


class ForgetfulStore(HonestStore):
    """Reads every entry, and reports all but the last of each call."""

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return super().get_into(keys, buffers)[:-1]


class ConfusedStore(HonestStore):
    """Answers the first key twice, then the others, then for no key of the call."""

    def read_each(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> Generator[tuple[Any, Any], None, None]:
        sizes = self.get_into(keys, buffers)
        yield 0, sizes[0]
        yield from enumerate(sizes)
        yield len(keys), 0
        yield -1, 0
        yield "0", 0
        yield 0, True


class PluginMedium(StoreMedium[HonestStore]):
    """A third-party medium over whichever store class ``store_class`` names."""

    event_medium = "plugin-store"
    store_class: ClassVar[type[HonestStore]] = HonestStore

    def create_store(self, options: Mapping[str, Any]) -> HonestStore:
        return self.store_class()


class ForgetfulMedium(PluginMedium):
    store_class = ForgetfulStore


class ConfusedMedium(PluginMedium):
    store_class = ConfusedStore


@pytest.fixture(autouse=True)
def _empty_store() -> Iterator[None]:
    HonestStore.entries.clear()
    yield
    HonestStore.entries.clear()


def plugin_config(medium: type[PluginMedium]) -> EngineConfig:
    return with_connector(
        tiny_config(), "OffloadConnector", {"medium": f"{__name__}:{medium.__name__}"}
    )


def warm_run(medium: type[PluginMedium]) -> tuple[list[RequestOutput], dict[str, Any]]:
    """Fill the store honestly, then run a fresh engine (its cache all zeros) over ``medium``."""
    generate(plugin_config(PluginMedium), workload())
    with LLMEngine(plugin_config(medium)) as engine:
        outputs = engine.generate(workload())
    return outputs, engine.connector_stats.reduce()


@pytest.mark.parametrize("medium", [ForgetfulMedium, ConfusedMedium])
def test_blocks_a_store_does_not_report_once_are_load_errors_and_outputs_stay(
    medium: type[PluginMedium], caplog: pytest.LogCaptureFixture
) -> None:
    reference = tokens(generate(tiny_config(), workload()))
    with caplog.at_level(logging.WARNING):
        outputs, stats = warm_run(medium)
    assert tokens(outputs) == reference
    assert stats["load_errors"] > 0
    # What the engine kept is only what verified.
    assert stats["blocks_loaded"] > 0
    warned = [record.getMessage() for record in caplog.records]
    assert any("plugin-store store" in message for message in warned), warned


def test_an_honest_plugin_store_serves_every_block() -> None:
    outputs, stats = warm_run(PluginMedium)
    assert served(outputs) > 0
    assert stats.get("load_errors", 0) == 0


SECRET = "hunter2-secret"


class MiscountingStore(HonestStore):
    """``count_prefix`` answers what ``answer`` makes of the keys (or raises it)."""

    answer: ClassVar[Any] = None

    def count_prefix(self, keys: Sequence[str]) -> Any:
        answer = type(self).answer
        if isinstance(answer, Exception):
            raise answer
        return answer(keys) if callable(answer) else answer


class MiscountingMedium(PluginMedium):
    store_class = MiscountingStore


@pytest.mark.parametrize(
    "answer",
    [
        lambda keys: len(keys) + 5,
        lambda keys: -1,
        "3",
        2.0,
        True,
        None,
        RuntimeError(f"lookup failed: password={SECRET} at redis://u:{SECRET}@h"),
    ],
    ids=["too-many", "negative", "str", "float", "bool", "none", "raises"],
)
def test_a_count_prefix_that_is_no_count_of_the_keys_is_a_miss(
    answer: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(MiscountingStore, "answer", answer)
    reference = tokens(generate(tiny_config(), workload()))
    generate(plugin_config(PluginMedium), workload())
    with caplog.at_level(logging.WARNING):
        outputs = generate(plugin_config(MiscountingMedium), workload())
    assert tokens(outputs) == reference
    assert served(outputs) == 0
    warned = [record.getMessage() for record in caplog.records]
    assert any(
        "MiscountingMedium" in message and "counted as a miss" in message for message in warned
    ), warned
    assert not any(SECRET in message for message in warned)
    # Rate-limited: one warning for the many lookups of the run.
    assert len([m for m in warned if "counted as a miss" in m]) == 1


class BrokenMedium(PluginMedium):
    """A medium whose hook named by ``broken`` misbehaves as ``behaviour`` says."""

    broken: ClassVar[str] = ""
    behaviour: ClassVar[Any] = None

    @classmethod
    def _misbehave(cls, hook: str, normal: Any) -> Any:
        if cls.broken != hook:
            return normal()
        if isinstance(cls.behaviour, Exception):
            raise cls.behaviour
        return cls.behaviour

    @classmethod
    def extra_config_keys(cls) -> Any:
        return cls._misbehave("extra_config_keys", super().extra_config_keys)

    @classmethod
    def finish_options(cls, connector_name: str, options: dict[str, Any]) -> Any:
        return cls._misbehave(
            "finish_options",
            lambda: super(BrokenMedium, cls).finish_options(connector_name, options),
        )

    def __init__(self, context: Any) -> None:
        type(self)._misbehave("__init__", lambda: None)
        super().__init__(context)

    def create_store(self, options: Mapping[str, Any]) -> HonestStore:
        return type(self)._misbehave(
            "create_store", lambda: super(BrokenMedium, self).create_store(options)
        )


LEAKY = RuntimeError(f"cannot reach redis://u:{SECRET}@h (password={SECRET}) " + "x" * 100_000)


def broken(monkeypatch: pytest.MonkeyPatch, hook: str, behaviour: Any) -> EngineConfig:
    monkeypatch.setattr(BrokenMedium, "broken", hook)
    monkeypatch.setattr(BrokenMedium, "behaviour", behaviour)
    return plugin_config(BrokenMedium)


def check(config: EngineConfig, tmp_path: Any) -> tuple[int, str]:
    """``kvwire check`` of ``config``'s connector, as a profile file: its status and stderr."""
    profile = tmp_path / "profile.yaml"
    transfer = config.kv_transfer_config
    assert transfer is not None
    profile.write_text(
        "kv_transfer_config:\n"
        f"  kv_connector: {transfer.kv_connector}\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        f"    medium: '{transfer.kv_connector_extra_config['medium']}'\n"
    )
    err = io.StringIO()
    status = check_profile(str(profile), out=io.StringIO(), err=err)
    return status, err.getvalue()


def assert_plugin_error(error: BaseException, call: str) -> None:
    message = str(error)
    assert message.startswith("kv_connector_extra_config.medium: "), message
    assert f"{call} raised RuntimeError: cannot reach redis://u:***@h" in message
    assert SECRET not in message
    assert len(message) < 600
    # Nothing chained: a traceback printed later would quote the plug-in's message raw.
    assert error.__cause__ is None and error.__suppress_context__


@pytest.mark.parametrize("hook", ["extra_config_keys", "finish_options"])
def test_a_medium_s_option_hooks_raising_are_refused_by_check_and_engine_naming_the_field(
    hook: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    config = broken(monkeypatch, hook, LEAKY)
    with pytest.raises(ExtraConfigError) as caught:
        LLMEngine(config)
    assert_plugin_error(caught.value, f"BrokenMedium.{hook}")
    status, err = check(config, tmp_path)
    assert status == 1
    assert f"BrokenMedium.{hook} raised RuntimeError: cannot reach redis://u:***@h" in err
    assert SECRET not in err


@pytest.mark.parametrize(
    ("hook", "answer"),
    [
        ("finish_options", None),
        ("finish_options", [("io_threads", 4)]),
        ("extra_config_keys", "io_threads"),
        ("extra_config_keys", None),
    ],
)
def test_a_medium_s_option_hooks_answering_the_wrong_type_are_refused_by_check(
    hook: str, answer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    config = broken(monkeypatch, hook, answer)
    status, err = check(config, tmp_path)
    assert status == 1
    assert f"kv_connector_extra_config.medium: BrokenMedium.{hook} returned {answer!r}" in err
    with pytest.raises(ExtraConfigError, match=rf"BrokenMedium\.{hook} returned"):
        LLMEngine(config)


@pytest.mark.parametrize("hook", ["__init__", "create_store"])
def test_a_medium_that_raises_when_built_stops_the_engine_naming_the_field(
    hook: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = broken(monkeypatch, hook, LEAKY)
    with pytest.raises(ExtraConfigError) as caught:
        LLMEngine(config)
    assert_plugin_error(
        caught.value, "BrokenMedium()" if hook == "__init__" else "BrokenMedium.create_store"
    )
