"""Who may read shared storage's KV files: exact modes whatever the umask, and a trusted owner.

KV blocks can reveal prompts. Entries are 0600 and folders 0700 by default
(``file_mode: private``), 0660 and 2770 with ``file_mode: group``; temporary
files are created exclusively and never through a link; a directory that
another user owns is refused unless ``allow_other_owner`` says to trust it.
"""

from __future__ import annotations

import itertools
import logging
import os
import pathlib
import stat
from collections.abc import Iterator

import pytest

from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import SharedStorageConnector
from kvwire.interface.base import KVConnectorRole
from kvwire.media.store.directory._modes import GROUP, PRIVATE, process_umask
from kvwire.media.store.directory.block_store import DirectoryBlockStore
from tests.support.pairs import build_connector, cache_config_for, engine_config

LAYOUT = "0123456789abcdef" * 2
KEY = f"{LAYOUT}/ab01"
ENTRY = memoryview(bytes(100))


@pytest.fixture(params=[0o022, 0o000, 0o077], ids=lambda umask: f"umask-{umask:03o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test under each usual umask (and one that opens everything)."""
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def mode_of(path: str | pathlib.Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def connector(path: pathlib.Path, **extra: object) -> SharedStorageConnector:
    config = engine_config("SharedStorageConnector", {"shared_storage_path": str(path), **extra})
    return build_connector(
        SharedStorageConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
    )


def test_the_umask_is_read_without_being_changed(umask: int):
    assert process_umask() == umask
    assert os.umask(umask) == umask


def test_entries_and_folders_are_owner_only_by_default(tmp_path: pathlib.Path, umask: int):
    store = DirectoryBlockStore(tmp_path, entry_bytes=len(ENTRY))
    assert store.put([KEY], [ENTRY]) == [True]
    entry = store.path_of(KEY)
    assert mode_of(entry) == 0o600
    assert mode_of(os.path.dirname(entry)) == 0o700
    assert mode_of(tmp_path / LAYOUT) == 0o700


def test_group_mode_shares_entries_and_folders_with_the_group(tmp_path: pathlib.Path, umask: int):
    store = DirectoryBlockStore(tmp_path, entry_bytes=len(ENTRY), modes=GROUP)
    assert store.put([KEY], [ENTRY]) == [True]
    entry = store.path_of(KEY)
    assert mode_of(entry) == 0o660
    assert mode_of(os.path.dirname(entry)) == stat.S_ISGID | 0o770
    assert mode_of(tmp_path / LAYOUT) == stat.S_ISGID | 0o770


def test_the_connector_creates_its_directory_owner_only(tmp_path: pathlib.Path, umask: int):
    connector(tmp_path / "kv")
    assert mode_of(tmp_path / "kv") == PRIVATE.folder


def test_the_connector_creates_a_group_directory_with_group_mode(
    tmp_path: pathlib.Path, umask: int
):
    connector(tmp_path / "kv", file_mode="group")
    assert mode_of(tmp_path / "kv") == GROUP.folder


def test_an_existing_directory_keeps_the_mode_its_user_gave_it(tmp_path: pathlib.Path):
    (tmp_path / "kv").mkdir(mode=0o755)
    os.chmod(tmp_path / "kv", 0o755)
    connector(tmp_path / "kv")
    assert mode_of(tmp_path / "kv") == 0o755


def planted_temporary_file(store: DirectoryBlockStore) -> pathlib.Path:
    """The name the store's next write will use for its temporary file."""
    store._serials = itertools.count(7)  # the name is random otherwise
    entry = pathlib.Path(store.path_of(KEY))
    entry.parent.mkdir(parents=True, exist_ok=True)
    return entry.parent / f".{entry.name}.{os.getpid()}.7.tmp"


def test_a_write_never_writes_through_a_link_at_its_temporary_name(tmp_path: pathlib.Path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's file")
    store = DirectoryBlockStore(tmp_path, entry_bytes=len(ENTRY))
    link = planted_temporary_file(store)
    link.symlink_to(victim)
    assert store.put([KEY], [ENTRY]) == [False]
    assert victim.read_bytes() == b"the user's file"
    assert link.is_symlink()
    assert store.count_prefix([KEY]) == 0


def test_a_write_that_finds_its_temporary_name_taken_leaves_that_file(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=len(ENTRY))
    other = planted_temporary_file(store)
    other.write_bytes(b"another writer's")
    assert store.put([KEY], [ENTRY]) == [False]
    assert other.read_bytes() == b"another writer's"


def test_temporary_names_differ_between_writes(tmp_path: pathlib.Path, monkeypatch):
    store = DirectoryBlockStore(tmp_path, entry_bytes=len(ENTRY))
    created: list[str] = []
    real_replace = os.replace

    def noting_replace(source: str, target: str) -> None:
        created.append(os.path.basename(source))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", noting_replace)
    store.put([KEY, KEY], [ENTRY, ENTRY])
    assert len(set(created)) == 2


@pytest.fixture
def others_directory(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory owned by another user (nobody's uid 65534); creating one needs root."""
    if os.geteuid() != 0:
        pytest.fail("this test chowns a directory to another user: run it as root")
    directory = tmp_path / "theirs"
    directory.mkdir()
    os.chown(directory, 65534, -1)
    return directory


def test_a_directory_owned_by_another_user_is_refused(others_directory: pathlib.Path):
    with pytest.raises(ExtraConfigError) as raised:
        connector(others_directory)
    message = str(raised.value)
    assert message.startswith("kv_connector_extra_config.shared_storage_path: ")
    assert "is owned by uid 65534, not by this process's uid 0" in message
    assert "kv_connector_extra_config.allow_other_owner: true" in message


def test_allow_other_owner_trusts_a_directory_of_another_user(others_directory: pathlib.Path):
    trusting = connector(others_directory, allow_other_owner=True)
    assert trusting.medium.store.count_prefix([KEY]) == 0


@pytest.mark.parametrize(
    ("mode", "file_mode", "writers"),
    [
        (0o777, "private", "every user"),
        (0o770, "private", "its group"),
        (0o777, "group", "every user"),
    ],
)
def test_a_directory_others_may_write_in_is_warned_about(
    tmp_path: pathlib.Path, caplog, mode: int, file_mode: str, writers: str
):
    os.chmod(tmp_path, mode)
    with caplog.at_level(logging.WARNING):
        connector(tmp_path, file_mode=file_mode)
    assert f"{writers} may write in this directory" in caplog.text


@pytest.mark.parametrize(("mode", "file_mode"), [(0o755, "private"), (0o2770, "group")])
def test_a_directory_only_its_sharers_may_write_in_is_not_warned_about(
    tmp_path: pathlib.Path, caplog, mode: int, file_mode: str
):
    os.chmod(tmp_path, mode)
    with caplog.at_level(logging.WARNING):
        connector(tmp_path, file_mode=file_mode)
    assert "may write in this directory" not in caplog.text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"file_mode": "shared"},
            "kv_connector_extra_config.file_mode: 'shared' is not accepted by "
            'SharedStorageConnector; expected "private" (entries 0600, folders 0700) or '
            '"group" (entries 0660, folders 2770)',
        ),
        (
            {"allow_other_owner": "yes"},
            "kv_connector_extra_config.allow_other_owner: 'yes' is not accepted by "
            "SharedStorageConnector; expected true or false",
        ),
    ],
)
def test_bad_trust_options_name_the_key_and_what_is_accepted(
    tmp_path: pathlib.Path, extra: dict[str, object], message: str
):
    with pytest.raises(ExtraConfigError) as raised:
        connector(tmp_path, **extra)
    assert message in str(raised.value)


def test_a_failed_save_under_a_long_root_is_warned_about_bounded(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "/".join(["r" * 200] * 15)
    root.mkdir(parents=True)
    store = DirectoryBlockStore(root, entry_bytes=10)
    root.rmdir()  # the save fails, and its error names a file under the root

    with caplog.at_level(logging.WARNING):
        assert store.put([f"{'0' * 32}/ab01"], [memoryview(bytes(10))]) == [False]

    assert "failed (directory_missing)" in caplog.text
    assert max(len(record.getMessage()) for record in caplog.records) < 400
