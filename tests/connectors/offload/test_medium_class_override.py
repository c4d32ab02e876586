"""A container's ``medium_class`` provider: the medium its offload connectors keep blocks in.

Overriding it swaps the medium for that container's connectors only, the way
overriding ``connector_class`` swaps the connector; the registry and every
other container keep theirs.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from dependency_injector import providers

from kvwire.container import container_for_profile
from kvwire.exceptions import ExtraConfigError
from kvwire.interface.base import KVConnectorRole
from kvwire.media.store.directory import DirectoryMedium
from kvwire.testing.faulty_medium import FaultInjectingMedium
from tests.support.pairs import cache_config_for, engine_config


class FaultyDirectory(FaultInjectingMedium):
    inner = DirectoryMedium


def _container(extra: dict[str, Any], connector: str = "SharedStorageConnector") -> Any:
    config = engine_config(connector, extra)
    return container_for_profile(config, kv_cache_config=cache_config_for(config))


def test_the_medium_class_is_the_one_the_profile_names(tmp_path: pathlib.Path) -> None:
    container = _container({"shared_storage_path": str(tmp_path)})

    assert container.medium_class() is DirectoryMedium
    assert type(container.worker_connector().medium) is DirectoryMedium


def test_overriding_the_medium_class_swaps_both_roles_media_of_that_container_only(
    tmp_path: pathlib.Path,
) -> None:
    overridden = _container({"shared_storage_path": str(tmp_path)})
    other = _container({"shared_storage_path": str(tmp_path)})

    with overridden.medium_class.override(providers.Object(FaultyDirectory)):
        scheduler = overridden.scheduler_connector()
        worker = overridden.worker_connector()

    assert scheduler.role is KVConnectorRole.SCHEDULER
    assert type(scheduler.medium) is FaultyDirectory
    assert type(worker.medium) is FaultyDirectory
    assert type(other.worker_connector().medium) is DirectoryMedium
    overridden.shutdown_resources()
    other.shutdown_resources()


def test_a_connector_that_keeps_no_medium_has_none() -> None:
    children = [{"kv_connector": "CPUOffloadConnector"}]
    container = _container({"connectors": children}, connector="MultiConnector")

    assert container.medium_class() is None


def test_an_unknown_medium_fails_the_build_naming_the_key(tmp_path: pathlib.Path) -> None:
    container = _container({"shared_storage_path": str(tmp_path), "medium": "tape"})

    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.medium: .*'tape'"):
        container.worker_connector()
