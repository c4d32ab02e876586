"""`StoreMedium.start_worker` / `stop_worker`, the old names of `start_sweeper` / `stop_sweeper`.

A store medium that still overrides the old names keeps its sweeper until the
next release: its class statement warns, and the medium starts and stops
the sweeper through its old-named methods.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from kvwire.interface.counters import Counters
from kvwire.media import TransferHandler
from kvwire.media.store.directory import DirectoryMedium
from tests.media.store.test_store_media import LAYOUT, NUM_BLOCKS, context
from tests.support.stores import layout_caches


def _old_style_medium() -> type[DirectoryMedium]:
    class OldStyleMedium(DirectoryMedium):
        calls: list[str] = []

        def start_worker(self, handler: TransferHandler) -> None:
            self.calls.append("start")
            super().start_worker(handler)  # the directory's sweep

        def stop_worker(self) -> None:
            self.calls.append("stop")
            super().stop_worker()

    return OldStyleMedium


def test_a_medium_that_overrides_only_the_old_names_warns_naming_the_new_ones() -> None:
    with pytest.warns(DeprecationWarning) as warned:
        _old_style_medium()

    messages = [str(warning.message) for warning in warned]
    assert len(messages) == 2
    assert "OldStyleMedium.start_worker is deprecated: name it start_sweeper" in messages[0]
    assert "OldStyleMedium.stop_worker is deprecated: name it stop_sweeper" in messages[1]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_old_named_overrides_start_and_stop_the_sweeper(tmp_path: pathlib.Path) -> None:
    medium_cls = _old_style_medium()
    medium = medium_cls(context({"shared_storage_path": str(tmp_path)}, medium=medium_cls))
    shard = tmp_path / medium.layout.fingerprint_hex / "ab"
    shard.mkdir(parents=True)
    stale = shard / ".ab12.4242.1.tmp"
    stale.write_bytes(b"half an entry")
    os.utime(stale, (0, 0))

    handler = medium.build_handler(layout_caches(LAYOUT, None, NUM_BLOCKS), Counters())
    handler.close()

    assert medium_cls.calls == ["start", "stop"]
    assert not stale.exists()  # the sweep the override's super() call reached


def test_calling_an_old_name_warns_and_reaches_the_new_one(tmp_path: pathlib.Path) -> None:
    class NewStyleMedium(DirectoryMedium):
        stopped = 0

        def stop_sweeper(self) -> None:
            type(self).stopped += 1

    medium = NewStyleMedium(context({"shared_storage_path": str(tmp_path)}, medium=NewStyleMedium))

    with pytest.warns(DeprecationWarning, match=r"stop_worker is deprecated: call stop_sweeper"):
        medium.stop_worker()
    assert NewStyleMedium.stopped == 1
