"""Plug-in stores that answer wrongly: never a wrong block loaded, never a crash.

A store that reports fewer results than keys, answers one key twice, names
no key of the call, or counts a prefix it cannot hold, runs the engine with
the outputs it would have without a connector: the blocks in question are
load errors or misses, with a rate-limited warning naming the medium.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest

from kvwire.config import EngineConfig
from kvwire.engine.engine import LLMEngine, RequestOutput
from kvwire.media.store.base import BlockStore
from kvwire.media.store.medium import StoreMedium
from tests.connectors.engine_support import (
    generate,
    served,
    tiny_engine_config,
    tokens,
    with_connector,
    workload,
)


class HonestStore(BlockStore):
    """Entries in one process-wide dict, answered truthfully; subclasses lie."""

    entries: ClassVar[dict[str, bytes]] = {}
    lock = threading.Lock()

    def count_prefix(self, keys: Sequence[str]) -> Any:
        with self.lock:
            held = 0
            while held < len(keys) and keys[held] in self.entries:
                held += 1
            return held

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        with self.lock:
            for key, entry in zip(keys, entries, strict=True):
                self.entries[key] = bytes(entry)
        return [True] * len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sizes: list[int | None] = []
        with self.lock:
            for key, buffer in zip(keys, buffers, strict=True):
                entry = self.entries.get(key)
                if entry is None or len(entry) > len(buffer):
                    sizes.append(None)
                    continue
                buffer[: len(entry)] = entry
                sizes.append(len(entry))
        return sizes


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
        tiny_engine_config(), "OffloadConnector", {"medium": f"{__name__}:{medium.__name__}"}
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
    reference = tokens(generate(tiny_engine_config(), workload()))
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
    reference = tokens(generate(tiny_engine_config(), workload()))
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
