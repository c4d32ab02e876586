"""A directory store removes only its own files: the user's files under its root survive.

kvwire's files are regular files named as its entries (a block hash in hex)
or its temporary files, in a shard folder (the hash's first two digits) of a
layout folder (32 hex digits). Eviction, the sweep of dead writers'
temporary files, a discard and a reset remove nothing else, whatever its
name resembles, and leave the folders that hold the user's files.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from kvwire.media.store.directory.block_store import DirectoryBlockStore

LAYOUT = "0123456789abcdef" * 2
ENTRY_BYTES = 100
USER_BYTES = 1000  # larger than an entry, and older: the first to go if it counted
# Files of the user's, each named near to kvwire's names (paths from the root).
USER_FILES = [
    "notes.txt",
    "ab",  # a shard's name, at the root
    "ab12.4242.1.tmp",
    f"{LAYOUT}.tmp",
    f"{LAYOUT}/readme",  # in a layout folder, beside its shards
    f"{LAYOUT}/ab12",  # an entry's name, one level too high
    f"{LAYOUT}/ab/ABCD",  # upper-case hex
    f"{LAYOUT}/ab/abc",  # an odd number of digits
    f"{LAYOUT}/ab/abcd.txt",
    f"{LAYOUT}/ab/cd12",  # in the wrong shard
    f"{LAYOUT}/ab/.ab12.tmp",  # a temporary file's name, but not kvwire's form
    f"{LAYOUT}/ab/.ab12.4242.1.tmp.bak",
    f"{LAYOUT}/ab/.cd12.4242.1.tmp",  # kvwire's form, in the wrong shard
    f"{LAYOUT}/ab/nested/ab12",  # an entry's name, one level too deep
    f"{LAYOUT}/ab/nested/.ab12.4242.1.tmp",
    f"{LAYOUT}/a/ab12",  # a shard folder's name that is not two digits
    f"{LAYOUT[:-1]}/ab/ab12",  # a layout folder's name one digit short
    f"{LAYOUT.upper()}/ab/ab12",
    "photos/ab/ab12",  # kvwire's shard and entry names in a folder of the user's
]


def plant_user_files(root: pathlib.Path) -> dict[pathlib.Path, bytes]:
    """The user's files, older than any entry: what each holds."""
    planted = {}
    for relative in USER_FILES:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        content = f"the user's {relative}".encode().ljust(USER_BYTES, b".")
        path.write_bytes(content)
        os.utime(path, (0, 0))
        planted[path] = content
    return planted


def assert_intact(planted: dict[pathlib.Path, bytes]) -> None:
    gone = [str(path) for path, content in planted.items() if not path.is_file()]
    assert gone == []
    assert all(path.read_bytes() == content for path, content in planted.items())


def key(number: int) -> str:
    return f"{LAYOUT}/ab{number:04x}"


def test_eviction_leaves_the_users_files_under_the_root(tmp_path: pathlib.Path):
    planted = plant_user_files(tmp_path)
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES, max_bytes=3 * ENTRY_BYTES)
    for number in range(6):
        assert store.put([key(number)], [memoryview(bytes(ENTRY_BYTES))]) == [True]
    assert_intact(planted)
    # Down to 90% of the cap at each of the two writes that crossed it.
    assert store.take_counters()["evicted_blocks"] == 4
    assert store.count_prefix([key(4), key(5)]) == 2


def test_eviction_counts_only_kvwires_entries_against_the_cap(tmp_path: pathlib.Path):
    plant_user_files(tmp_path)
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES, max_bytes=3 * ENTRY_BYTES)
    for number in range(3):
        store.put([key(number)], [memoryview(bytes(ENTRY_BYTES))])
    assert store.evict() == 3 * ENTRY_BYTES
    assert store.take_counters().get("evicted_blocks", 0) == 0


def test_eviction_never_removes_a_link_named_as_an_entry(tmp_path: pathlib.Path):
    target = tmp_path / "kept"
    target.write_bytes(b"the user's file")
    shard = tmp_path / LAYOUT / "ab"
    shard.mkdir(parents=True)
    link = shard / "ab99"
    link.symlink_to(target)
    os.utime(link, (0, 0), follow_symlinks=False)
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES, max_bytes=ENTRY_BYTES)
    for number in range(3):
        store.put([key(number)], [memoryview(bytes(ENTRY_BYTES))])
    assert link.is_symlink() and target.read_bytes() == b"the user's file"


def test_the_sweep_removes_only_kvwires_stale_temporary_files(tmp_path: pathlib.Path):
    planted = plant_user_files(tmp_path)
    shard = tmp_path / LAYOUT / "ab"
    stale = shard / ".ab12.4242.1.tmp"
    stale.write_bytes(b"half an entry")
    os.utime(stale, (0, 0))
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES)
    assert store.sweep_stale_temporary_files() == 1
    assert not stale.exists()
    assert_intact(planted)


def test_a_discard_never_removes_a_link_in_an_entrys_place(tmp_path: pathlib.Path):
    target = tmp_path / "kept"
    target.write_bytes(b"the user's file")
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES)
    link = pathlib.Path(store.path_of(key(1)))
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    store.discard([key(1)])
    assert link.is_symlink() and target.exists()
    assert store.take_removed_keys() == []


def test_a_reset_removes_the_layouts_entries_and_nothing_else(tmp_path: pathlib.Path):
    planted = plant_user_files(tmp_path)
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES)
    store.put([key(1), key(2)], [memoryview(bytes(ENTRY_BYTES))] * 2)
    assert store.remove_layout(LAYOUT) is True
    assert store.count_prefix([key(1)]) == store.count_prefix([key(2)]) == 0
    assert_intact(planted)


def test_a_reset_removes_the_layout_folder_once_empty(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES)
    store.put([key(1), f"{LAYOUT}/cd01"], [memoryview(bytes(ENTRY_BYTES))] * 2)
    assert store.remove_layout(LAYOUT) is True
    assert list(tmp_path.iterdir()) == []


def test_a_reset_refuses_a_name_that_is_no_layout(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES)
    with pytest.raises(ValueError, match="not a fingerprint of 32 lowercase hex digits"):
        store.remove_layout("..")


def evict_the_only_entry_of_shard_cd(store: DirectoryBlockStore) -> pathlib.Path:
    """Fill shard ``cd`` with one old entry, then write past the cap; the shard's folder."""
    store.put([f"{LAYOUT}/cd01"], [memoryview(bytes(ENTRY_BYTES))])
    os.utime(store.path_of(f"{LAYOUT}/cd01"), (0, 0))
    store.put([key(1)], [memoryview(bytes(ENTRY_BYTES))])
    assert store.count_prefix([f"{LAYOUT}/cd01"]) == 0
    return pathlib.Path(store.root) / LAYOUT / "cd"


def test_a_shard_folder_emptied_just_now_stays_for_a_writer_about_to_use_it(
    tmp_path: pathlib.Path,
):
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES, max_bytes=ENTRY_BYTES)
    assert evict_the_only_entry_of_shard_cd(store).is_dir()


def test_eviction_removes_shard_folders_that_stayed_empty(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES, max_bytes=ENTRY_BYTES)
    shard = evict_the_only_entry_of_shard_cd(store)
    os.utime(shard, (0, 0))
    store.evict()
    assert [p.name for p in (tmp_path / LAYOUT).iterdir()] == ["ab"]


def test_eviction_keeps_a_shard_folder_that_holds_a_users_file(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES, max_bytes=ENTRY_BYTES)
    store.put([f"{LAYOUT}/cd01"], [memoryview(bytes(ENTRY_BYTES))])
    os.utime(store.path_of(f"{LAYOUT}/cd01"), (0, 0))
    users = tmp_path / LAYOUT / "cd" / "notes.txt"
    users.write_bytes(b"the user's")
    store.put([key(1)], [memoryview(bytes(ENTRY_BYTES))])
    assert store.count_prefix([f"{LAYOUT}/cd01"]) == 0
    assert users.read_bytes() == b"the user's"


def test_the_sweep_removes_shard_folders_that_stayed_empty(tmp_path: pathlib.Path):
    shard = tmp_path / LAYOUT / "ab"
    shard.mkdir(parents=True)
    os.utime(shard, (0, 0))
    DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES).sweep_stale_temporary_files()
    assert not shard.exists()


def test_the_sweep_keeps_shard_folders_that_are_not_kvwires(tmp_path: pathlib.Path):
    folders = [tmp_path / LAYOUT / "AB", tmp_path / LAYOUT / "abc", tmp_path / "photos" / "ab"]
    for folder in folders:
        folder.mkdir(parents=True)
        os.utime(folder, (0, 0))
    DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES).sweep_stale_temporary_files()
    assert all(folder.is_dir() for folder in folders)


def test_a_write_recreates_a_shard_folder_removed_as_empty(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES)
    store.put([key(1)], [memoryview(bytes(ENTRY_BYTES))])
    assert store.remove_layout(LAYOUT) is True
    assert store.put([key(2)], [memoryview(bytes(ENTRY_BYTES))]) == [True]
    assert store.count_prefix([key(2)]) == 1


def test_keys_of_another_form_are_refused_before_any_file_is_touched(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=ENTRY_BYTES)
    for bad in ("layout/ab12", f"{LAYOUT}/../ab12", f"{LAYOUT}/AB12", f"{LAYOUT}/abc"):
        with pytest.raises(ValueError, match="is not '<layout>/<block hash>'"):
            store.path_of(bad)
        assert store.put([bad], [memoryview(bytes(ENTRY_BYTES))]) == [False]
    assert list(tmp_path.iterdir()) == []
