"""A LoRA adapter's key: from its weights, pinned by the id it is served under."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from kvwire.identity.adapter_keys import WARNING_INTERVAL_S, AdapterKeys, fold_block_hash
from kvwire.identity.file_digests import FileDigests

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def save_adapter(directory: pathlib.Path, weights: bytes, alpha: int = 16) -> pathlib.Path:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": alpha}))
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return directory


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def keys(tmp_path: pathlib.Path) -> AdapterKeys:
    return AdapterKeys(FileDigests(str(tmp_path / "digests"), settle_ns=0), clock=Clock())


def test_two_adapters_at_the_same_relative_path_have_different_keys(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_adapter(tmp_path / "a" / "lora", b"first adapter")
    save_adapter(tmp_path / "b" / "lora", b"second adapter")
    monkeypatch.chdir(tmp_path / "a")
    first = AdapterKeys(FileDigests(None)).key(1, "lora", "lora")
    monkeypatch.chdir(tmp_path / "b")
    second = AdapterKeys(FileDigests(None)).key(1, "lora", "lora")
    assert first is not None and second is not None and first != second


def test_the_same_adapter_anywhere_has_one_key(keys: AdapterKeys, tmp_path: pathlib.Path) -> None:
    first = save_adapter(tmp_path / "host-a" / "lora", b"adapter")
    copy = save_adapter(tmp_path / "elsewhere", b"adapter")
    assert keys.key(1, "x", str(first)) == keys.key(2, "y", str(copy)) is not None
    assert keys.key(1, "x", str(first)) == keys.key(1, "x", str(first))


def test_an_adapter_s_config_is_part_of_its_key(keys: AdapterKeys, tmp_path: pathlib.Path) -> None:
    plain = save_adapter(tmp_path / "plain", b"adapter", alpha=16)
    scaled = save_adapter(tmp_path / "scaled", b"adapter", alpha=32)
    assert keys.key(1, "a", str(plain)) != keys.key(2, "b", str(scaled))


def test_an_adapter_changed_while_served_under_its_id_shares_nothing_after(
    keys: AdapterKeys, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = save_adapter(tmp_path / "lora", b"adapter")
    assert keys.key(1, "lora", str(adapter)) is not None
    (adapter / "adapter_model.safetensors").write_bytes(b"retrained adapter")
    with caplog.at_level(logging.WARNING, logger="kvwire.identity.adapter_keys"):
        assert keys.key(1, "lora", str(adapter)) is None
    assert "new lora_int_id" in caplog.text
    # The worker may hold either version under id 1; a new id is identified afresh.
    assert keys.key(1, "lora", str(adapter)) is None
    assert keys.key(2, "lora-v2", str(adapter)) is not None


def test_an_id_pointed_at_another_path_shares_nothing_after(
    keys: AdapterKeys, tmp_path: pathlib.Path
) -> None:
    first = save_adapter(tmp_path / "first", b"adapter")
    other = save_adapter(tmp_path / "other", b"another adapter")
    assert keys.key(1, "lora", str(first)) is not None
    assert keys.key(1, "lora", str(other)) is None


def test_an_unreadable_adapter_has_no_key_and_is_warned_about_at_a_bounded_rate(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    keys = AdapterKeys(FileDigests(None), clock=clock)
    adapter = save_adapter(tmp_path / "lora", b"adapter")
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to(tmp_path / "gone")
    with caplog.at_level(logging.WARNING, logger="kvwire.identity.adapter_keys"):
        for _ in range(50):
            assert keys.key(1, "lora", str(adapter)) is None
        clock.now += WARNING_INTERVAL_S
        assert keys.key(1, "lora", str(adapter)) is None
    assert len(caplog.records) == 2
    assert "'adapter_model.safetensors'" in caplog.records[0].getMessage()
    assert "49 more such requests" in caplog.records[1].getMessage()
    # Readable again (a download finished): identified at its next request.
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").write_bytes(b"adapter")
    assert keys.key(1, "lora", str(adapter)) is not None


def test_a_hub_adapter_is_its_downloaded_commit(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "hub" / "models--org--adapter"
    save_adapter(folder / "snapshots" / COMMIT, b"adapter")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    keys = AdapterKeys(FileDigests(None), hub_caches=[str(tmp_path / "hub")])
    assert keys.key(1, "a", "org/adapter") is not None
    assert (
        AdapterKeys(FileDigests(None), hub_caches=[str(tmp_path)]).key(1, "a", "org/adapter")
        is None
    )


def test_folding_binds_a_block_to_its_adapter() -> None:
    block = bytes(range(32))
    assert fold_block_hash(b"a" * 32, block) != fold_block_hash(b"b" * 32, block)
    assert fold_block_hash(b"a" * 32, block) != block
    assert len(fold_block_hash(b"a" * 32, block)) == 32
