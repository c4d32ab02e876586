"""A plug-in store that raises, exits or answers short mid-run: one warning, never a traceback.

Its transfers fail (load errors computed again, blocks not stored), the
engine finishes with the outputs it has without a connector, and the
warning names the store's call with its message redacted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kvwire.config import EngineConfig
from kvwire.engine.engine import LLMEngine, RequestOutput
from tests.support.engines import generate, tiny_config, tokens, with_connector, workload
from tests.support.stores import (
    SECRET,
    DictMedium,
    DictStore,
    ExitingMedium,
    RaisingDiscardMedium,
    RaisingMedium,
    RaisingRemovedKeysMedium,
    ShortReplyMedium,
)


@pytest.fixture(autouse=True)
def _empty_store() -> Iterator[None]:
    DictStore.entries.clear()
    yield
    DictStore.entries.clear()


def plugin_config(medium: type[DictMedium]) -> EngineConfig:
    spec = f"{medium.__module__}:{medium.__name__}"
    return with_connector(tiny_config(), "OffloadConnector", {"medium": spec})


def run(medium: type[DictMedium]) -> tuple[list[RequestOutput], dict[str, Any]]:
    with LLMEngine(plugin_config(medium)) as engine:
        outputs = engine.generate(workload())
    return outputs, engine.connector_stats.reduce()


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("kvwire.media.store")]


@pytest.mark.parametrize(
    ("medium", "raised"),
    [(RaisingMedium, "ConnectionError"), (ExitingMedium, "SystemExit")],
)
def test_a_store_whose_get_into_raises_fails_its_loads_with_one_line_and_no_traceback(
    medium: type[DictMedium], raised: str, caplog: pytest.LogCaptureFixture
) -> None:
    reference = tokens(generate(tiny_config(), workload()))
    generate(plugin_config(DictMedium), workload())  # filled by an honest store
    with caplog.at_level(logging.WARNING):
        outputs, stats = run(medium)
    assert tokens(outputs) == reference
    assert stats["load_errors"] > 0
    records = store_warnings(caplog)
    messages = [record.getMessage() for record in records]
    expected = (
        f"plugin-store store: {medium.store_class.__name__}.read_into_ranges raised "
        f"{raised}: lost redis://u:***@h"
    )
    assert any(expected in message for message in messages), messages
    assert all(record.exc_info is None for record in records), messages
    assert not any(SECRET in message for message in messages)


@pytest.mark.parametrize(
    ("medium", "raised"),
    [(RaisingMedium, "ConnectionError"), (ExitingMedium, "SystemExit")],
)
def test_a_store_whose_put_raises_stores_nothing_with_one_line_and_no_traceback(
    medium: type[DictMedium], raised: str, caplog: pytest.LogCaptureFixture
) -> None:
    reference = tokens(generate(tiny_config(), workload()))
    with caplog.at_level(logging.WARNING):
        outputs, stats = run(medium)
    assert tokens(outputs) == reference
    assert stats["save_errors"] > 0 and stats.get("blocks_saved", 0) == 0
    records = store_warnings(caplog)
    messages = [record.getMessage() for record in records]
    expected = (
        f"plugin-store store: {medium.store_class.__name__}.write_ranges raised "
        f"{raised}: lost redis://u:***@h"
    )
    assert any(expected in message for message in messages), messages
    assert all(record.exc_info is None for record in records), messages
    assert not any(SECRET in message for message in messages)


def test_a_short_put_reply_counts_its_blocks_unsaved_and_says_what_the_store_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        _outputs, stats = run(ShortReplyMedium)
    assert stats["save_errors"] > 0 and stats.get("blocks_saved", 0) == 0
    messages = [record.getMessage() for record in store_warnings(caplog)]
    assert any(
        "plugin-store store: ShortReplyStore.put answered a list of" in message
        and "expected one true or false per entry" in message
        for message in messages
    ), messages
    # kvwire's own zip() never sees the reply: no error of kvwire's about lengths.
    assert not any("zip()" in message for message in messages)
    assert all(record.exc_info is None for record in store_warnings(caplog))


def test_a_store_whose_take_removed_keys_raises_still_saves_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        _outputs, stats = run(RaisingRemovedKeysMedium)
    # The entries were written: only the report of what the store removed is lost.
    assert stats["blocks_saved"] > 0 and stats.get("save_errors", 0) == 0
    records = store_warnings(caplog)
    messages = [record.getMessage() for record in records]
    assert any(
        "plugin-store store: RaisingRemovedKeysStore.take_removed_keys raised ConnectionError: "
        "lost redis://u:***@h" in message
        for message in messages
    ), messages
    assert all(record.exc_info is None for record in records), messages
    assert not any(SECRET in message for message in messages)


def test_a_store_whose_discard_raises_leaves_its_corrupt_entries_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reference = tokens(generate(tiny_config(), workload()))
    generate(plugin_config(DictMedium), workload())
    # Every stored entry damaged: each load fails its check, and is to be discarded.
    for key, entry in list(DictStore.entries.items()):
        DictStore.entries[key] = entry[:-1] + bytes([entry[-1] ^ 0xFF])
    with caplog.at_level(logging.WARNING):
        outputs, stats = run(RaisingDiscardMedium)
    assert tokens(outputs) == reference
    assert stats["corrupt_entries"] > 0
    records = store_warnings(caplog)
    messages = [record.getMessage() for record in records]
    assert any(
        "plugin-store store: RaisingDiscardStore.discard raised ConnectionError: "
        "lost redis://u:***@h" in message
        for message in messages
    ), messages
    assert all(record.exc_info is None for record in records), messages
    assert not any(SECRET in message for message in messages)
