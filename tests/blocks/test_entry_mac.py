"""The MAC key and sealed entries: forged entries are refused, the key is never shown."""

from __future__ import annotations

import io
import pathlib
import struct

import attrs
import pytest
import yaml

from kvwire.blocks.format import (
    HEADER_SIZE,
    BlockLayout,
    CorruptBlockError,
    payload_checksum,
    verify_entry,
    write_header,
)
from kvwire.blocks.mac import MAX_VARIABLE_NAME, EntryMac, MacKeyError
from kvwire.cli import check_profile
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import SharedStorageConnector
from tests.support.connectors import read_options
from tests.support.pairs import engine_config

VARIABLE = "KVWIRE_TEST_MAC_KEY"
# A sentinel no output may ever contain.
KEY = "SENTINEL-mac-key-0123456789abcdef0123456789abcdef"
LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
SEALED = attrs.evolve(LAYOUT, mac=EntryMac(KEY.encode(), VARIABLE))
BLOCK_HASH = bytes(range(32))
CHECKSUM_AT = struct.calcsize("<4sHH16s32s5IQ")
FLAGS_AT = CHECKSUM_AT + 8
MAC_AT = FLAGS_AT + 4


def encoded(layout: BlockLayout, block_hash: bytes = BLOCK_HASH) -> bytearray:
    entry = bytearray(layout.entry_bytes)
    entry[HEADER_SIZE:] = bytes(i % 251 for i in range(layout.payload_bytes))
    write_header(memoryview(entry), layout, block_hash)
    return entry


def forged(entry: bytearray) -> bytearray:
    """``entry`` with another payload and a checksum that matches it: what a writer can do."""
    entry[HEADER_SIZE:] = bytes(len(entry) - HEADER_SIZE)
    struct.pack_into("<Q", entry, CHECKSUM_AT, payload_checksum(memoryview(entry)[HEADER_SIZE:]))
    return entry


# ---------------------------------------------------------------- the format


def test_a_sealed_entry_verifies() -> None:
    verify_entry(memoryview(encoded(SEALED)), SEALED, BLOCK_HASH)


def test_without_a_key_a_forged_entry_with_a_valid_checksum_verifies() -> None:
    # The threat the MAC answers: the checksum alone cannot tell.
    verify_entry(memoryview(forged(encoded(LAYOUT))), LAYOUT, BLOCK_HASH)


def test_with_a_key_a_forged_entry_with_a_valid_checksum_is_refused() -> None:
    with pytest.raises(CorruptBlockError, match="MAC mismatch with an intact checksum"):
        verify_entry(memoryview(forged(encoded(SEALED))), SEALED, BLOCK_HASH)


def test_with_a_key_an_entry_written_without_a_mac_is_refused() -> None:
    entry = forged(encoded(SEALED))
    entry[FLAGS_AT:HEADER_SIZE] = bytes(HEADER_SIZE - FLAGS_AT)
    with pytest.raises(CorruptBlockError, match="not sealed with a MAC, and this engine requires"):
        verify_entry(memoryview(entry), SEALED, BLOCK_HASH)


def test_without_a_key_a_sealed_entry_is_refused() -> None:
    with pytest.raises(CorruptBlockError, match="sealed with a MAC, and this engine has no MAC"):
        verify_entry(memoryview(encoded(SEALED)), LAYOUT, BLOCK_HASH)


def test_a_sealed_entry_moved_to_another_block_hash_is_refused() -> None:
    # Every other header field matches the new place: only the MAC covers the hash.
    other_hash = bytes(32)
    entry = encoded(SEALED)
    entry[24:56] = other_hash
    with pytest.raises(CorruptBlockError, match="MAC mismatch"):
        verify_entry(memoryview(entry), SEALED, other_hash)


def test_a_damaged_mac_is_refused() -> None:
    entry = encoded(SEALED)
    entry[MAC_AT + 5] ^= 0x01
    with pytest.raises(CorruptBlockError, match="MAC mismatch"):
        verify_entry(memoryview(entry), SEALED, BLOCK_HASH)


def test_a_damaged_sealed_payload_is_named_as_damage_not_forgery() -> None:
    entry = encoded(SEALED)
    entry[-1] ^= 0x01
    with pytest.raises(CorruptBlockError, match="payload checksum mismatch"):
        verify_entry(memoryview(entry), SEALED, BLOCK_HASH)


def test_sealed_entries_and_each_keys_are_named_apart() -> None:
    same_key = attrs.evolve(LAYOUT, mac=EntryMac(KEY.encode(), "ANOTHER_VARIABLE"))
    other_key = attrs.evolve(LAYOUT, mac=EntryMac(KEY.encode() + b"!", VARIABLE))
    assert SEALED.fingerprint == same_key.fingerprint
    assert len({LAYOUT.fingerprint, SEALED.fingerprint, other_key.fingerprint}) == 3


# ----------------------------------------------------------------- the key


def test_an_unset_variable_is_an_error_naming_it() -> None:
    with pytest.raises(MacKeyError, match=f"environment variable '{VARIABLE}' is not set"):
        EntryMac.from_environment(VARIABLE, {})


def test_an_empty_variable_is_an_error_naming_it() -> None:
    with pytest.raises(MacKeyError, match=f"environment variable '{VARIABLE}' is empty"):
        EntryMac.from_environment(VARIABLE, {VARIABLE: ""})


def test_a_too_short_key_is_an_error_that_never_shows_it() -> None:
    short = "SENTINEL-short-key"
    with pytest.raises(MacKeyError, match="shorter than 32 bytes") as raised:
        EntryMac.from_environment(VARIABLE, {VARIABLE: short})
    assert short not in str(raised.value)


@pytest.mark.parametrize(
    "given", [KEY, "0123456789abcdef" * 4, "lowercase_name", 12345, None], ids=repr
)
def test_anything_but_a_variable_name_is_refused_without_being_echoed(given: object) -> None:
    with pytest.raises(MacKeyError, match="expected the name of an environment variable") as raised:
        EntryMac.from_environment(given, {str(given): KEY})
    assert str(given) not in str(raised.value)


def test_an_overlong_variable_name_is_refused_without_being_echoed() -> None:
    name = "K" * (MAX_VARIABLE_NAME + 1)
    with pytest.raises(MacKeyError, match="expected the name of an environment variable") as raised:
        EntryMac.from_environment(name, {})
    assert len(str(raised.value)) < 300


def test_a_key_that_is_not_utf8_is_taken_as_the_environment_holds_it() -> None:
    raw = b"\xff\xfe" * 20
    mac = EntryMac.from_environment(VARIABLE, {VARIABLE: raw.decode("utf-8", "surrogateescape")})
    assert mac.key_id == EntryMac(raw, VARIABLE).key_id


def test_the_repr_names_the_variable_and_never_the_key() -> None:
    mac = EntryMac.from_environment(VARIABLE, {VARIABLE: KEY})
    layout = attrs.evolve(LAYOUT, mac=mac)
    for text in (repr(mac), repr(layout), str(layout)):
        assert VARIABLE in text
        assert KEY not in text
        assert KEY.encode().hex() not in text


# ------------------------------------------------------------- the profile


def check_output(
    tmp_path: pathlib.Path, connector: str, extra: dict[str, object]
) -> tuple[int, str]:
    """``kvwire check`` of a profile naming ``connector`` with ``extra``: status, all it printed."""
    path = tmp_path / "profile.yaml"
    transfer = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    path.write_text(yaml.safe_dump({"kv_transfer_config": transfer}))
    out, err = io.StringIO(), io.StringIO()
    status = check_profile(str(path), out=out, err=err)
    return status, out.getvalue() + err.getvalue()


def shared_storage_extra(tmp_path: pathlib.Path, **extra: object) -> dict[str, object]:
    return {"shared_storage_path": str(tmp_path / "store"), **extra}


def test_a_connector_with_an_unset_key_variable_fails_naming_the_field_and_variable(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    config = engine_config(
        "SharedStorageConnector", shared_storage_extra(tmp_path, mac_key_env=VARIABLE)
    )
    message = f"kv_connector_extra_config.mac_key_env: environment variable '{VARIABLE}' is not set"
    with pytest.raises(ExtraConfigError, match=message):
        read_options(SharedStorageConnector, config.kv_transfer_config)


def test_check_names_the_tiered_profiles_child_whose_key_variable_is_unset(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    children = [
        {"kv_connector": "CPUOffloadConnector", "kv_connector_extra_config": {}},
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": shared_storage_extra(tmp_path, mac_key_env=VARIABLE),
        },
    ]
    status, output = check_output(tmp_path, "MultiConnector", {"connectors": children})
    child = "kv_connector_extra_config.connectors[1].kv_connector_extra_config.mac_key_env"
    assert status == 1
    assert f"{child}: environment variable '{VARIABLE}' is not set" in output


def test_the_key_itself_is_never_accepted_in_a_profile(tmp_path: pathlib.Path) -> None:
    config = engine_config("SharedStorageConnector", shared_storage_extra(tmp_path, mac_key=KEY))
    with pytest.raises(ExtraConfigError, match="mac_key is not an option") as raised:
        read_options(SharedStorageConnector, config.kv_transfer_config)
    assert KEY not in str(raised.value)


def test_check_passes_a_profile_whose_key_is_set_and_never_prints_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VARIABLE, KEY)
    extra = shared_storage_extra(tmp_path, mac_key_env=VARIABLE)
    status, output = check_output(tmp_path, "SharedStorageConnector", extra)
    assert status == 0, output
    assert KEY not in output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"mac_key_env": VARIABLE}, "shorter than 32 bytes"),
        ({"mac_key_env": KEY}, "never the key itself"),
        ({"mac_key": KEY}, "mac_key is not an option"),
    ],
    ids=["short-key", "key-as-variable-name", "key-in-profile"],
)
def test_check_fails_a_bad_key_setting_without_printing_the_key(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, str], message: str
) -> None:
    monkeypatch.setenv(VARIABLE, KEY[:20])
    status, output = check_output(
        tmp_path, "SharedStorageConnector", shared_storage_extra(tmp_path, **extra)
    )
    assert status == 1
    assert message in output
    assert KEY[:20] not in output


def test_a_key_put_in_a_profile_by_mistake_never_shows_in_a_repr(tmp_path: pathlib.Path) -> None:
    config = engine_config("SharedStorageConnector", shared_storage_extra(tmp_path, mac_key=KEY))
    for text in (repr(config), repr(config.kv_transfer_config), str(config)):
        assert "mac_key" in text
        assert KEY not in text


def test_an_entry_refused_for_its_mac_leaves_no_view_of_its_buffer_behind() -> None:
    # A log handler may keep the error and its traceback: a mapped entry must still close.
    entry = forged(encoded(SEALED))
    view = memoryview(entry)
    with pytest.raises(CorruptBlockError, match="MAC mismatch") as kept:
        verify_entry(view, SEALED, BLOCK_HASH)
    view.release()
    entry.extend(b"\0")  # a BufferError while any view of the entry is alive
    assert "MAC mismatch" in kept.value.reason
