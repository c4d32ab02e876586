"""Entries kept out of the page cache (``page_cache: drop``).

A disk store larger than memory, or one in a container whose page cache
counts against its memory limit, must not fill the host's memory with its
entries. With ``page_cache: drop`` each entry is written to the disk and its
pages dropped once written, and again once read; the test asks the kernel
(``mincore``) which of an entry's pages are resident. The default keeps them
as the system decides, which the first test shows the check can see.
"""

from __future__ import annotations

import errno
import os
import pathlib

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import SharedStorageConnector
from kvwire.interface.base import KVConnectorRole
from kvwire.media.store.directory.block_store import DirectoryBlockStore
from tests.support.page_cache import resident_pages
from tests.support.pairs import build_connector, cache_config_for, engine_config
from tests.support.stores import HASHES, load_into_blocks_2_and_3, save_blocks_0_and_1

# One entry of 2 layers x (keys, values) x 16 tokens x 4 heads x 64 x float32: 64 KiB.
LAYOUT = BlockLayout(num_layers=2, block_size=16, num_kv_heads=4, head_size=64, dtype="float32")


def entry_files(store: DirectoryBlockStore) -> list[str]:
    return [store.path_of(LAYOUT.key(block_hash)) for block_hash in HASHES]


def test_kept_entries_stay_in_the_page_cache(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=LAYOUT.entry_bytes)
    save_blocks_0_and_1(store, LAYOUT, seed=1)
    assert all(resident_pages(path) > 0 for path in entry_files(store))


def test_dropped_entries_leave_the_page_cache_once_written_and_once_read(
    tmp_path: pathlib.Path,
):
    store = DirectoryBlockStore(tmp_path, entry_bytes=LAYOUT.entry_bytes, drop_from_page_cache=True)
    saved = save_blocks_0_and_1(store, LAYOUT, seed=2)
    assert [resident_pages(path) for path in entry_files(store)] == [0, 0]

    loaded, errors = load_into_blocks_2_and_3(store, LAYOUT)

    assert errors == set()
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, 2:4], cache[:, 0:2])
    assert [resident_pages(path) for path in entry_files(store)] == [0, 0]


def test_dropping_writes_each_entry_to_the_disk_before_dropping_its_pages(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    calls: list[str] = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append("fdatasync"))
    real_fadvise = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append("dontneed" if advice == os.POSIX_FADV_DONTNEED else str(advice))
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    store = DirectoryBlockStore(tmp_path, entry_bytes=LAYOUT.entry_bytes, drop_from_page_cache=True)
    save_blocks_0_and_1(store, LAYOUT, seed=3)
    assert calls == ["fdatasync", "dontneed"] * 2


def connector(path: pathlib.Path, **extra: object) -> SharedStorageConnector:
    config = engine_config("SharedStorageConnector", {"shared_storage_path": str(path), **extra})
    return build_connector(
        SharedStorageConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
    )


@pytest.mark.parametrize("value", ["evict", True, None])
def test_a_page_cache_other_than_keep_or_drop_is_named_with_what_is_accepted(
    tmp_path: pathlib.Path, value: object
):
    with pytest.raises(ExtraConfigError) as raised:
        connector(tmp_path, page_cache=value)
    assert (
        f"kv_connector_extra_config.page_cache: {value!r} is not accepted by "
        'SharedStorageConnector; expected "keep" (entries stay in the page cache as the system '
        'decides) or "drop" (written to the disk and dropped from the page cache after each '
        "write and read)"
    ) in str(raised.value)


def test_an_entry_that_cannot_be_written_to_the_disk_is_not_published(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    def failing_fdatasync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing_fdatasync)
    store = DirectoryBlockStore(tmp_path, entry_bytes=16, drop_from_page_cache=True)
    key = f"{'0' * 32}/ab01"

    assert store.put([key], [memoryview(bytes(16))]) == [False]

    assert store.count_prefix([key]) == 0
    # Neither the entry nor its temporary file is left behind.
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []
    assert store.take_counters() == {"write_io_errors": 1}
