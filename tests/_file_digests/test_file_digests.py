"""Whole-file digests, remembered while a file is unchanged, in a cache only its user can write."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import stat

import pytest

from kvwire._file_digests import UNCACHED_BYTES, FileDigests, FileStamp

SIZE = UNCACHED_BYTES + 4096


def write_file(path: pathlib.Path, fill: int = 1) -> pathlib.Path:
    path.write_bytes(bytes([fill]) * SIZE)
    return path


def entry_path(cache: pathlib.Path, file: pathlib.Path) -> pathlib.Path:
    return cache / FileStamp.of(os.stat(file)).entry_name()


@pytest.fixture
def cache(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "cache" / "kvwire" / "file-digests"


def digests(cache: pathlib.Path) -> FileDigests:
    # Files written by the test just now count as settled.
    return FileDigests(str(cache), settle_ns=0)


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
    [b"not json", b"[]", b'{"version": 1}', b'{"version": 1, "stamp": [], "sha256": "x"}', b""],
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
    with caplog.at_level(logging.WARNING, logger="kvwire._file_digests"):
        assert (
            digests(cache).digest(str(weights)) == hashlib.sha256(weights.read_bytes()).hexdigest()
        )
    assert "cannot be used" in caplog.text
    assert not [path for path in tmp_path.rglob("*.json")]


def test_the_cache_keeps_the_newest_entries_and_deletes_only_its_own(
    tmp_path: pathlib.Path, cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvwire._file_digests.MAX_ENTRIES", 2)
    files = [write_file(tmp_path / f"w{index}.safetensors", index) for index in range(4)]
    cache.mkdir(parents=True, mode=0o700)
    (cache / "notes.txt").write_text("not kvwire's")
    for index, file in enumerate(files):
        digests(cache).digest(str(file))
        os.utime(entry_path(cache, file), ns=(index * 10**9, index * 10**9))
    kept = sorted(path.name for path in cache.glob("*.json"))
    assert kept == sorted(entry_path(cache, file).name for file in files[2:])
    assert (cache / "notes.txt").read_text() == "not kvwire's"


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
