"""Whole-file digests, remembered while a file is unchanged, in a cache only its user can write."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import stat

import pytest

from kvwire.exceptions import ModelIdentityError
from kvwire.identity.file_digests import UNCACHED_BYTES, FileChangedError, FileDigests, FileStamp

SIZE = UNCACHED_BYTES + 4096


def write_file(path: pathlib.Path, fill: int = 1) -> pathlib.Path:
    path.write_bytes(bytes([fill]) * SIZE)
    return path


def entry_path(cache: pathlib.Path, file: pathlib.Path) -> pathlib.Path:
    return cache / FileStamp.of(os.stat(file)).entry_name()


@pytest.fixture
def cache(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "cache" / "kvwire" / "file-digests"


def digests(cache: pathlib.Path, max_entries: int = 4096) -> FileDigests:
    # Files written by the test just now count as settled.
    return FileDigests(str(cache), settle_ns=0, max_entries=max_entries)


def sparse_files(directory: pathlib.Path, count: int) -> list[str]:
    """`count` weight files past the size read at each call, holding no disk blocks."""
    directory.mkdir()
    paths = []
    for index in range(count):
        path = directory / f"model-{index:05d}.safetensors"
        with open(path, "wb") as file:
            file.truncate(SIZE)
        paths.append(str(path))
    return paths


def test_a_digest_is_of_every_byte_and_remembered_owner_only(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    weights = write_file(tmp_path / "w.safetensors")
    assert digests(cache).digest(str(weights)) == hashlib.sha256(weights.read_bytes()).hexdigest()
    entry = entry_path(cache, weights)
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert (
        json.loads(entry.read_text())["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    )


def test_a_remembered_digest_is_used_while_the_file_is_unchanged(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    weights = write_file(tmp_path / "w.safetensors")
    digests(cache).digest(str(weights))
    entry = entry_path(cache, weights)
    remembered = json.loads(entry.read_text())
    remembered["sha256"] = "ab" * 32
    entry.write_text(json.dumps(remembered))
    assert digests(cache).digest(str(weights)) == "ab" * 32


def test_a_file_rewritten_with_its_size_and_mtime_restored_is_read_again(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    weights = write_file(tmp_path / "w.safetensors")
    before = os.stat(weights)
    first = digests(cache).digest(str(weights))
    with open(weights, "r+b") as file:
        file.seek(SIZE // 2)
        file.write(b"\xff")
    # A rewrite that puts the modification time back still changes st_ctime.
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(weights).st_mtime_ns == before.st_mtime_ns
    assert digests(cache).digest(str(weights)) != first


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"version": 1}',
        b'{"version": 1, "stamp": [], "sha256": "x"}',
        b"",
        # Nested past Python's recursion limit: json raises RecursionError.
        b"[" * 3000,
        b'{"a": ' * 1500,
        b"1" * 4000,
        b"\xff\xfe not utf-8",
    ],
)
def test_a_malformed_entry_is_never_believed_and_is_written_over(
    tmp_path: pathlib.Path, cache: pathlib.Path, body: bytes
) -> None:
    weights = write_file(tmp_path / "w.safetensors")
    digests(cache).digest(str(weights))
    entry = entry_path(cache, weights)
    entry.write_bytes(body)
    assert digests(cache).digest(str(weights)) == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert json.loads(entry.read_text())["stamp"] == FileStamp.of(os.stat(weights)).as_list()


def test_an_entry_of_another_file_s_stamp_is_not_believed(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    first = write_file(tmp_path / "a.safetensors", 1)
    second = write_file(tmp_path / "b.safetensors", 2)
    digests(cache).digest(str(first))
    # The first file's entry (its digest, its stamp) put where the second's is looked up.
    entry_path(cache, first).rename(entry_path(cache, second))
    assert digests(cache).digest(str(second)) == hashlib.sha256(second.read_bytes()).hexdigest()


@pytest.mark.parametrize("problem", ["group-writable", "a link"])
def test_a_cache_directory_others_could_write_is_not_used(
    tmp_path: pathlib.Path, cache: pathlib.Path, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    weights = write_file(tmp_path / "w.safetensors")
    if problem == "group-writable":
        cache.mkdir(parents=True)
        cache.chmod(0o770)
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        cache.parent.mkdir(parents=True)
        cache.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="kvwire.identity.file_digests"):
        assert (
            digests(cache).digest(str(weights)) == hashlib.sha256(weights.read_bytes()).hexdigest()
        )
    assert "cannot be used" in caplog.text
    assert not [path for path in tmp_path.rglob("*.json")]


@pytest.mark.parametrize(
    "fields",
    [
        {"version": True},
        {"version": 1.0},
        {"stamp_as": "floats"},
        {"stamp_as": "a string"},
        {"sha256": 7},
        {"sha256": "AB" * 32},
        {"extra": "field"},
    ],
)
def test_an_entry_of_other_field_types_or_fields_is_not_believed_and_is_written_over(
    tmp_path: pathlib.Path, cache: pathlib.Path, fields: dict[str, object]
) -> None:
    weights = write_file(tmp_path / "w.safetensors")
    digests(cache).digest(str(weights))
    stamp = FileStamp.of(os.stat(weights)).as_list()
    entry: dict[str, object] = {"version": 1, "stamp": stamp, "sha256": "ab" * 32, **fields}
    stamp_as = entry.pop("stamp_as", None)
    if stamp_as == "floats":
        entry["stamp"] = [float(value) for value in stamp]
    elif stamp_as == "a string":
        entry["stamp"] = str(stamp)
    entry_path(cache, weights).write_text(json.dumps(entry))
    assert digests(cache).digest(str(weights)) == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert json.loads(entry_path(cache, weights).read_text())["sha256"] != "ab" * 32


def test_the_cache_prunes_the_least_recently_used_entries_and_deletes_only_its_own(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    files = [write_file(tmp_path / f"w{index}.safetensors", index) for index in range(4)]
    cache.mkdir(parents=True, mode=0o700)
    (cache / "notes.txt").write_text("not kvwire's")
    for index, file in enumerate(files):
        digests(cache, max_entries=2).digest(str(file))
        os.utime(entry_path(cache, file), ns=(index * 10**9, index * 10**9))
    kept = sorted(path.name for path in cache.glob("*.json"))
    assert kept == sorted(entry_path(cache, file).name for file in files[2:])
    assert (cache / "notes.txt").read_text() == "not kvwire's"


def test_an_entry_recalled_counts_as_used_and_outlives_older_ones(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    files = [write_file(tmp_path / f"w{index}.safetensors", index) for index in range(3)]
    for index, file in enumerate(files[:2]):
        digests(cache).digest(str(file))
        os.utime(entry_path(cache, file), ns=(index * 10**9, index * 10**9))
    # The older entry is used again: the other one is the least recently used.
    digests(cache).digest(str(files[0]))
    digests(cache, max_entries=2).digest(str(files[2]))
    assert entry_path(cache, files[0]).exists()
    assert not entry_path(cache, files[1]).exists()


def test_the_cache_prunes_only_a_quarter_past_its_bound_and_then_down_to_it(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    paths = sparse_files(tmp_path / "model", 11)
    file_digests = digests(cache, max_entries=8)
    for path in paths[:10]:
        file_digests.digest(path)
    # Pruning lists and stats every entry: it waits until a quarter more were written.
    assert len(list(cache.glob("*.json"))) == 10
    file_digests.digest(paths[10])
    assert len(list(cache.glob("*.json"))) == 8
    assert entry_path(cache, pathlib.Path(paths[10])).exists()


def test_a_model_of_more_files_than_the_bound_is_read_once_then_recalled_whole(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    paths = sparse_files(tmp_path / "model", 40)
    first_start = digests(cache, max_entries=8)
    with first_start.keeping_model(len(paths)):
        for path in paths:
            first_start.digest(path)
    assert first_start.files_read == 40
    second_start = digests(cache, max_entries=8)
    with second_start.keeping_model(len(paths)):
        for path in paths:
            second_start.digest(path)
    assert second_start.files_read == 0


def test_no_entry_of_the_model_being_digested_is_pruned(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    model = sparse_files(tmp_path / "model", 8)
    with digests(cache).keeping_model(len(model)):
        for path in model:
            digests(cache).digest(path)
    # Other models' entries, more of them and written later.
    others = sparse_files(tmp_path / "others", 12)
    for path in others:
        digests(cache).digest(path)
    changed = pathlib.Path(model[0])
    with open(changed, "r+b") as file:
        file.write(b"\1")
    again = digests(cache, max_entries=8)
    with again.keeping_model(len(model)):
        for path in model:
            again.digest(path)
    assert again.files_read == 1
    assert all(entry_path(cache, pathlib.Path(path)).exists() for path in model)
    assert not any(entry_path(cache, pathlib.Path(path)).exists() for path in others)


def test_a_file_changed_just_now_is_digested_but_not_remembered(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    weights = write_file(tmp_path / "w.safetensors")
    FileDigests(str(cache)).digest(str(weights))
    assert not entry_path(cache, weights).exists()


def test_a_small_file_is_read_at_each_call_and_never_remembered(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    config = tmp_path / "config.json"
    config.write_text("{}")
    assert digests(cache).digest(str(config)) == hashlib.sha256(b"{}").hexdigest()
    assert not cache.exists()


def test_a_file_whose_stamp_is_not_the_one_expected_is_refused_unread(
    tmp_path: pathlib.Path, cache: pathlib.Path
) -> None:
    weights = write_file(tmp_path / "w.safetensors")
    stamped = FileStamp.of(os.stat(weights))
    replacement = write_file(tmp_path / "new.safetensors", 2)
    replacement.rename(weights)
    file_digests = digests(cache)
    with pytest.raises(FileChangedError, match="changed since it was stamped"):
        file_digests.digest(str(weights), stamped)
    assert file_digests.files_read == 0
    assert file_digests.digest(str(weights), FileStamp.of(os.stat(weights))) == (
        hashlib.sha256(weights.read_bytes()).hexdigest()
    )


def test_kvwire_digest_cache_off_reads_every_file_whole_and_remembers_none(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KVWIRE_DIGEST_CACHE", "off")
    weights = write_file(tmp_path / "w.safetensors")
    file_digests = FileDigests(settle_ns=0)
    file_digests.digest(str(weights))
    file_digests.digest(str(weights))
    assert file_digests.files_read == 2
    assert not (tmp_path / "xdg").exists()


@pytest.mark.parametrize("setting", ["", "on"])
def test_kvwire_digest_cache_on_or_empty_keeps_the_cache(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KVWIRE_DIGEST_CACHE", setting)
    weights = write_file(tmp_path / "w.safetensors")
    FileDigests(settle_ns=0).digest(str(weights))
    again = FileDigests(settle_ns=0)
    again.digest(str(weights))
    assert again.files_read == 0


@pytest.mark.parametrize("setting", ["0", "OFF", "no", "off " + "x" * 500])
def test_another_kvwire_digest_cache_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    monkeypatch.setenv("KVWIRE_DIGEST_CACHE", setting)
    with pytest.raises(ModelIdentityError, match="KVWIRE_DIGEST_CACHE: expected 'off'") as raised:
        FileDigests()
    assert len(str(raised.value)) < 400
