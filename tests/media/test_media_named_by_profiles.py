"""What the offload connector's restructuring (one connector over media, split by role) got wrong.

Each test names a behaviour the connectors had before the media became
plug-ins, or one a profile naming a medium relies on: a medium named by a
hostile profile (a module that raises, a malformed path, a URL, an abstract
class) is refused naming ``kv_connector_extra_config.medium``, bounded and
without its secrets, by ``kvwire check`` as by the engine; an installed
medium whose name is taken is ignored out loud, as a connector is; a
wrapping medium keeps the stored layout of the medium it wraps; a store
medium that does not name itself appears in KV cache events as ``store``.
"""

from __future__ import annotations

import io
import logging
import os
import pathlib
import sys
from collections.abc import Iterator, Mapping
from importlib import metadata
from typing import Any

import pytest
import yaml

from kvwire.cli import check_profile
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import OffloadConnector
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import BlockStored
from kvwire.media.store.directory import DirectoryBlockStore, DirectoryMedium
from kvwire.media.store.medium import StoreMedium
from kvwire.registry import ConnectorRegistry, default_registry
from kvwire.registry.media import MEDIA_ENTRY_POINT_GROUP, MediumRegistry
from kvwire.testing.faulty_medium import FaultInjectingMedium
from tests.support.pairs import (
    build_connector,
    cache_config_for,
    engine_config,
    make_request,
)

SECRET = "hunter2-review-secret"
MAC_VARIABLE = "KVWIRE_TEST_REVIEW_MAC_KEY"
# A module name no other test uses: a module whose import failed is not cached.
RAISING_MODULE = "kvwire_review_raising_medium"


def _refusal(medium: object) -> str:
    """The error ``validate_extra_config`` (``kvwire check``'s path) raises for ``medium``."""
    config = engine_config("OffloadConnector", {"medium": medium})
    with pytest.raises(ExtraConfigError) as refused:
        OffloadConnector.validate_extra_config(config.kv_transfer_config, default_registry())
    return str(refused.value)


@pytest.fixture
def raising_module(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module on the path whose import raises a RuntimeError quoting a secret, at length."""
    source = f"raise RuntimeError('cannot start: password={SECRET} ' + 'x' * 100_000)\n"
    (tmp_path / f"{RAISING_MODULE}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield RAISING_MODULE
    sys.modules.pop(RAISING_MODULE, None)


def test_a_medium_module_that_raises_at_import_is_refused_bounded_naming_the_key(
    raising_module: str,
):
    message = _refusal(f"{raising_module}:Medium")

    assert message.startswith("kv_connector_extra_config.medium: ")
    assert "RuntimeError: cannot start" in message
    assert SECRET not in message
    assert len(message) < 1000


def test_a_medium_module_with_a_syntax_error_is_refused_naming_the_key(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "kvwire_review_broken_medium.py").write_text("def (\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    message = _refusal("kvwire_review_broken_medium:Medium")

    assert message.startswith("kv_connector_extra_config.medium: ")
    assert "SyntaxError" in message


@pytest.mark.parametrize(
    "medium", [".relative:Medium", "kvwire..media:Medium", "kvwire.media:Not a class"]
)
def test_a_medium_path_that_names_no_module_and_class_is_refused_naming_the_key(medium: str):
    message = _refusal(medium)

    assert message.startswith("kv_connector_extra_config.medium: ")
    assert "'package.module:Class'" in message


def test_a_url_typed_as_the_medium_is_refused_without_its_password():
    # "os" imports, so the rest would be looked up as the class: never echo it.
    message = _refusal(f"os://kvuser:{SECRET}@cache.internal:6379/0")

    assert message.startswith("kv_connector_extra_config.medium: ")
    assert SECRET not in message


@pytest.mark.parametrize(
    ("medium", "missing"),
    [
        ("kvwire.media.base:Medium", "build_handler, build_index, extra_config_keys"),
        ("kvwire.media.store.medium:StoreMedium", "create_store"),
    ],
)
def test_an_abstract_medium_is_refused_by_the_check_as_by_the_engine(medium: str, missing: str):
    # The engine cannot build it; a check that passed it would let the profile through.
    message = _refusal(medium)

    assert message.startswith("kv_connector_extra_config.medium: ")
    assert f"is abstract (it does not implement {missing})" in message


def test_kvwire_check_reports_a_medium_module_that_raises_as_a_profile_error(
    raising_module: str, tmp_path: pathlib.Path
):
    profile = tmp_path / "profile.yaml"
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"medium": f"{raising_module}:Medium"},
    }
    profile.write_text(yaml.safe_dump({"kv_transfer_config": transfer}))
    out, err = io.StringIO(), io.StringIO()

    status = check_profile(
        str(profile), registry=ConnectorRegistry(entry_point_group=None), out=out, err=err
    )

    assert status == 1
    assert "error: kv_connector_extra_config.medium: " in err.getvalue()
    assert SECRET not in err.getvalue()


class _InstalledMedia:
    """``importlib.metadata`` as seen with two distributions naming media already taken."""

    @staticmethod
    def entry_points(group: str) -> list[metadata.EntryPoint]:
        assert group == MEDIA_ENTRY_POINT_GROUP
        return [
            metadata.EntryPoint("directory", "shadowing_media:Directory", group),
            metadata.EntryPoint("tape", "tape_media:Tape", group),
            metadata.EntryPoint("tape", "other_tape_media:Tape", group),
        ]


def test_a_medium_entry_point_whose_name_is_taken_is_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    # As for connectors: the built-in (or first) name wins, and the operator is told.
    monkeypatch.setattr("kvwire.registry.names.metadata", _InstalledMedia)
    registry = MediumRegistry()

    with caplog.at_level(logging.WARNING, logger="kvwire.registry"):
        entries = {entry.name: entry.target for entry in registry.entries()}

    assert entries["directory"] == "kvwire.media.store.directory.medium:DirectoryMedium"
    assert entries["tape"] == "tape_media:Tape"
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2
    assert warnings[0].startswith(
        "Ignoring entry point 'directory = shadowing_media:Directory' of distribution "
        "'<unknown distribution>': "
        "medium 'directory' is already registered (built in, kvwire.media.store.directory.medium:"
    )
    assert warnings[1].startswith("Ignoring entry point 'tape = other_tape_media:Tape'")


class FaultyDirectory(FaultInjectingMedium):
    inner = DirectoryMedium


def test_a_faulty_medium_over_a_sealed_store_has_the_store_s_layout(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    # The connector's layout is the stored one (the MAC's id is in its
    # fingerprint, so in every key): the faulty medium must not unseal it.
    monkeypatch.setenv(MAC_VARIABLE, "k" * 32)
    extra = {"shared_storage_path": str(tmp_path), "mac_key_env": MAC_VARIABLE}
    plain_config = engine_config("OffloadConnector", {**extra, "medium": "directory"})
    faulty_config = engine_config(
        "OffloadConnector", {**extra, "medium": f"{__name__}:FaultyDirectory"}
    )
    cache = cache_config_for(plain_config)
    plain = build_connector(OffloadConnector, plain_config, KVConnectorRole.SCHEDULER, cache)
    faulty = build_connector(OffloadConnector, faulty_config, KVConnectorRole.SCHEDULER, cache)
    try:
        block_hash = bytes(range(32))
        assert faulty.layout.mac is not None
        assert faulty.layout.key(block_hash) == plain.layout.key(block_hash)
        assert faulty.layout.key(block_hash) == faulty.group_layouts[0].key(block_hash)
    finally:
        plain.shutdown()
        faulty.shutdown()


class UnnamedStoreMedium(StoreMedium[DirectoryBlockStore]):
    """A third-party store medium that does not set ``event_medium``."""

    def create_store(self, options: Mapping[str, Any]) -> DirectoryBlockStore:
        return DirectoryBlockStore(
            os.environ["KVWIRE_TEST_REVIEW_STORE"], entry_bytes=self.layout.entry_bytes
        )


def test_a_store_medium_that_names_no_medium_reports_its_blocks_as_store(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, open_pair: Any
):
    # As every store-backed connector did before media: "store", not the
    # generic medium's placeholder.
    monkeypatch.setenv("KVWIRE_TEST_REVIEW_STORE", str(tmp_path))
    config = engine_config("OffloadConnector", {"medium": f"{__name__}:UnnamedStoreMedium"})
    pair = open_pair(config, OffloadConnector, 3)
    request = make_request("r", list(range(9)), pair.block_size)
    pair.prefill(request, [1, 2, 3])
    assert pair.worker.wait_for_pending_saves(30)

    events = pair.worker.get_kv_connector_kv_cache_events()

    assert events == [BlockStored(tuple(request.block_hashes[:2]), "store", 0)]
