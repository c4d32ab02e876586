"""`staging_buffer_bytes`, the deprecated name of a store medium's `max_save_bytes_in_flight`.

A profile that still sets the old key keeps its cap until the next release,
warned (a `DeprecationWarning`, and a log warning an operator sees); giving
both names is an error, and the old name is in no list of accepted keys.
"""

from __future__ import annotations

import logging

import pytest

from kvwire.config.extra_config import ExtraConfigError, read_extra_config
from kvwire.media.store.directory import DirectoryMedium

CONNECTOR = "SharedStorageConnector"
KEYS = DirectoryMedium.extra_config_keys()


def test_the_old_name_sets_the_cap_warned_naming_the_new_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.WARNING),
        pytest.warns(DeprecationWarning, match="staging_buffer_bytes of SharedStorageConnector"),
    ):
        options = read_extra_config(
            CONNECTOR, {"shared_storage_path": "/x", "staging_buffer_bytes": "1MiB"}, KEYS
        )

    assert options["max_save_bytes_in_flight"] == 1024**2
    assert "staging_buffer_bytes" not in options
    assert "is deprecated: name it max_save_bytes_in_flight" in caplog.text


def test_the_new_name_sets_the_cap_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    options = read_extra_config(
        CONNECTOR, {"shared_storage_path": "/x", "max_save_bytes_in_flight": "2MiB"}, KEYS
    )

    assert options["max_save_bytes_in_flight"] == 2 * 1024**2
    assert [w for w in recwarn if issubclass(w.category, DeprecationWarning)] == []


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_both_names_at_once_are_refused() -> None:
    extra = {
        "shared_storage_path": "/x",
        "staging_buffer_bytes": "1MiB",
        "max_save_bytes_in_flight": "2MiB",
    }

    with pytest.raises(
        ExtraConfigError,
        match=r"max_save_bytes_in_flight is given twice, as max_save_bytes_in_flight and "
        r"staging_buffer_bytes; give it once",
    ):
        read_extra_config(CONNECTOR, extra, KEYS)


def test_a_bad_value_under_the_old_name_is_refused_naming_the_key(
    recwarn: pytest.WarningsRecorder,
) -> None:
    with pytest.raises(ExtraConfigError, match=r"max_save_bytes_in_flight: 'big' is not accepted"):
        read_extra_config(
            CONNECTOR, {"shared_storage_path": "/x", "staging_buffer_bytes": "big"}, KEYS
        )


def test_an_unknown_key_lists_only_the_current_names() -> None:
    with pytest.raises(ExtraConfigError) as refused:
        read_extra_config(CONNECTOR, {"shared_storage_path": "/x", "typo": 1}, KEYS)

    assert "max_save_bytes_in_flight" in str(refused.value)
    assert "staging_buffer_bytes" not in str(refused.value)
