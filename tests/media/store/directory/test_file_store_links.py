"""A folder of the store replaced by a link never leads kvwire to the files it points at.

Whoever may write in the shared directory can swap a layout or shard folder
for a symbolic link to a folder of someone's files named like kvwire's
entries, even between the scan that found an entry and its removal. kvwire
removes entries relative to the folder it scanned, opened without following
links, so the files behind a link survive every removal: eviction, a
discard, a reset.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest

from kvwire.media.store.directory import block_store as file_store
from kvwire.media.store.directory.block_store import DirectoryBlockStore

LAYOUT = "0123456789abcdef" * 2
ENTRY_BYTES = 100


def key(number: int) -> str:
    return f"{LAYOUT}/ab{number:04x}"


def users_folder(tmp_path: pathlib.Path, names: list[str]) -> dict[pathlib.Path, bytes]:
    """A folder outside the store holding the user's files, named as kvwire's entries."""
    folder = tmp_path / "users-files"
    folder.mkdir()
    planted = {}
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"the user's {name}".encode().ljust(ENTRY_BYTES, b"."))
        os.utime(path, (0, 0))  # older than any entry: the first eviction would pick them
        planted[path] = path.read_bytes()
    return planted


def assert_intact(planted: dict[pathlib.Path, bytes]) -> None:
    assert {path: path.read_bytes() for path in planted if path.is_file()} == planted


def test_a_reset_never_removes_files_behind_a_layout_folder_that_is_a_link(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "store"
    root.mkdir()
    planted = users_folder(tmp_path, ["ab/ab0001", "cd/cd0001"])
    (root / LAYOUT).symlink_to(tmp_path / "users-files")
    store = DirectoryBlockStore(root, entry_bytes=ENTRY_BYTES)

    store.remove_layout(LAYOUT)

    assert_intact(planted)


def test_a_discard_never_removes_a_file_behind_a_shard_folder_that_is_a_link(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "store"
    (root / LAYOUT).mkdir(parents=True)
    planted = users_folder(tmp_path, ["ab0001"])
    (root / LAYOUT / "ab").symlink_to(tmp_path / "users-files")
    store = DirectoryBlockStore(root, entry_bytes=ENTRY_BYTES)

    store.discard([key(1)])

    assert_intact(planted)
    assert store.take_removed_keys() == []


def test_eviction_never_follows_a_shard_folder_swapped_for_a_link_after_its_scan(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    root.mkdir()
    writer = DirectoryBlockStore(root, entry_bytes=ENTRY_BYTES)
    for number in range(3):
        assert writer.put([key(number)], [memoryview(bytes(ENTRY_BYTES))]) == [True]
    planted = users_folder(tmp_path, [f"ab{number:04x}" for number in range(3)])
    shard = root / LAYOUT / "ab"
    scan_shard = file_store.scan_shard

    def scan_then_swap(*args: Any) -> Any:
        contents = scan_shard(*args)
        # Between the scan and the removals, a hostile writer swaps the folder.
        shard.rename(root / LAYOUT / "moved-away")
        shard.symlink_to(tmp_path / "users-files")
        return contents

    monkeypatch.setattr(file_store, "scan_shard", scan_then_swap)
    evicting = DirectoryBlockStore(root, entry_bytes=ENTRY_BYTES, max_bytes=ENTRY_BYTES)

    evicting.evict()

    assert_intact(planted)
    # The entries scanned stay where they went, for a later eviction.
    assert len(os.listdir(root / LAYOUT / "moved-away")) == 3
    assert evicting.take_removed_keys() == []


def test_an_oversized_file_read_through_a_shard_folder_link_is_never_removed(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "store"
    (root / LAYOUT).mkdir(parents=True)
    users_file = tmp_path / "users-files" / "ab0001"
    users_file.parent.mkdir()
    users_file.write_bytes(b"x" * (ENTRY_BYTES + 1))  # an entry too long: discarded if kvwire's
    (root / LAYOUT / "ab").symlink_to(users_file.parent)
    store = DirectoryBlockStore(root, entry_bytes=ENTRY_BYTES)

    assert store.get_into([key(1)], [memoryview(bytearray(ENTRY_BYTES))]) == [None]

    assert users_file.read_bytes() == b"x" * (ENTRY_BYTES + 1)
