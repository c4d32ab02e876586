"""`MediumIndex.prepare_store` / `complete_store`: old names of `prepare_save` / `complete_save`.

A third-party index that still overrides only the old names keeps working
until the next release: its class statement warns, and the connector, which
calls only the new names, reaches its old-named methods.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.connectors.offload._planner import BlockPlanner
from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
from kvwire.interface.types import BlockHash
from kvwire.media import MediumIndex

HASHES = (b"a", b"b")


def _old_style_index() -> MediumIndex:
    class OldStyleIndex(MediumIndex):
        def __init__(self) -> None:
            self.completed: list[tuple[int, tuple[BlockHash, ...], bool]] = []

        def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
            return 0

        def prepare_store(
            self, group: int, block_hashes: Sequence[BlockHash]
        ) -> list[tuple[BlockHash, int | None]]:
            return [(block_hash, 10 + i) for i, block_hash in enumerate(block_hashes)]

        def complete_store(
            self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
        ) -> None:
            self.completed.append((group, tuple(block_hashes), success))

    return OldStyleIndex()


def _scheduler(index: MediumIndex) -> OffloadSchedulerHalf:
    planner = BlockPlanner(4, (CacheGroup(0, ("l0",), 4),), loads=True, saves=True)
    return OffloadSchedulerHalf(index=index, planner=planner, num_groups=1, async_load=False)


def test_an_index_that_overrides_only_the_old_names_warns_naming_the_new_ones() -> None:
    with pytest.warns(DeprecationWarning) as warned:
        _old_style_index()

    messages = [str(warning.message) for warning in warned]
    assert len(messages) == 2
    assert "OldStyleIndex.prepare_store is deprecated: name it prepare_save" in messages[0]
    assert "OldStyleIndex.complete_store is deprecated: name it complete_save" in messages[1]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_connector_places_and_settles_saves_through_the_old_names() -> None:
    index = _old_style_index()
    scheduler = _scheduler(index)
    save = BlockTransfer(request_id="r", block_ids=(1, 2), block_hashes=HASHES)

    placed = scheduler._place_save(save)
    scheduler._drop_save(save)

    assert placed is not None
    assert placed.slots == (10, 11)
    assert index.completed == [(0, HASHES, False)]  # type: ignore[attr-defined]


def test_an_old_named_override_that_calls_super_gets_the_default() -> None:
    with pytest.warns(DeprecationWarning):

        class ByKeyIndex(MediumIndex):
            def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
                return 0

            def prepare_store(
                self, group: int, block_hashes: Sequence[BlockHash]
            ) -> list[tuple[BlockHash, int | None]]:
                return super().prepare_store(group, block_hashes)[:1]

    with pytest.warns(DeprecationWarning, match=r"MediumIndex\.prepare_store is deprecated"):
        assert ByKeyIndex().prepare_save(0, HASHES) == [(b"a", None)]


def test_calling_an_old_name_warns_and_reaches_the_new_one() -> None:
    class NewStyleIndex(MediumIndex):
        def __init__(self) -> None:
            self.completed: list[bool] = []

        def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
            return 0

        def prepare_save(
            self, group: int, block_hashes: Sequence[BlockHash]
        ) -> list[tuple[BlockHash, int | None]]:
            return [(block_hashes[-1], 3)]

        def complete_save(
            self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
        ) -> None:
            self.completed.append(success)

    index = NewStyleIndex()

    with pytest.warns(DeprecationWarning, match=r"prepare_store is deprecated: call prepare_save"):
        assert index.prepare_store(0, HASHES) == [(b"b", 3)]
    with pytest.warns(
        DeprecationWarning, match=r"complete_store is deprecated: call complete_save"
    ):
        index.complete_store(0, HASHES, success=True)
    assert index.completed == [True]


def test_an_index_with_the_current_names_defines_its_class_without_a_warning(
    recwarn: pytest.WarningsRecorder,
) -> None:
    class CurrentIndex(MediumIndex):
        def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
            return 0

        def prepare_save(
            self, group: int, block_hashes: Sequence[BlockHash]
        ) -> list[tuple[BlockHash, int | None]]:
            return []

    assert [w for w in recwarn if issubclass(w.category, DeprecationWarning)] == []
    assert _scheduler(CurrentIndex())._places_saves
