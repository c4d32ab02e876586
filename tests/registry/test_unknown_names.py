"""An unknown connector or medium name keeps its error's first words and says what was meant."""

from __future__ import annotations

import pytest

from kvwire.config import KVTransferConfig
from kvwire.registry import ConnectorRegistry, UnknownMediumError
from kvwire.registry.names import MAX_LISTED_NAMES


def test_a_misspelt_connector_gets_vllms_sentence_then_the_closest_name() -> None:
    registry = ConnectorRegistry(entry_point_group=None)

    with pytest.raises(ValueError) as caught:
        registry.resolve(KVTransferConfig(kv_connector="CPUOfloadConnector", kv_role="kv_both"))

    assert str(caught.value) == (
        "Unsupported connector type: CPUOfloadConnector (did you mean CPUOffloadConnector?); "
        "known connectors: CPUOffloadConnector, OffloadConnector, SharedStorageConnector, "
        "MultiConnector, RedisConnector, TieredOffloadConnector (kvwire connectors lists them, "
        "with their modules)"
    )


def test_a_connector_name_in_the_wrong_case_is_found_as_the_closest() -> None:
    registry = ConnectorRegistry(entry_point_group=None)

    with pytest.raises(ValueError, match=r"\(did you mean RedisConnector\?\)"):
        registry.resolve(KVTransferConfig(kv_connector="redisconnector", kv_role="kv_both"))


def test_the_known_connectors_listed_are_bounded() -> None:
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    for index in range(MAX_LISTED_NAMES + 5):
        registry.register_connector(f"Plugin{index}", "somewhere", "Plugin")

    with pytest.raises(ValueError) as caught:
        registry.resolve(KVTransferConfig(kv_connector="Zzz", kv_role="kv_both"))

    message = str(caught.value)
    assert f"Plugin{MAX_LISTED_NAMES - 1}, and 5 more (kvwire connectors" in message
    assert f"Plugin{MAX_LISTED_NAMES}," not in message


def test_a_misspelt_medium_gets_the_closest_name_and_where_every_medium_is_listed() -> None:
    registry = ConnectorRegistry(entry_point_group=None)

    with pytest.raises(UnknownMediumError) as caught:
        registry.media.get_class("cpu_pol")

    assert str(caught.value) == (
        "unknown medium 'cpu_pol'; expected one of cpu_pool, directory, peer, redis, tiered, or a "
        "class as 'package.module:Class'; did you mean 'cpu_pool'? (kvwire connectors lists every "
        "medium)"
    )


def test_a_medium_name_like_none_gets_no_guess() -> None:
    registry = ConnectorRegistry(entry_point_group=None)

    with pytest.raises(UnknownMediumError) as caught:
        registry.media.get_class("tape")

    assert "did you mean" not in str(caught.value)


def test_a_name_sharing_only_the_connector_suffix_gets_no_guess() -> None:
    registry = ConnectorRegistry(entry_point_group=None)

    with pytest.raises(ValueError) as caught:
        registry.resolve(KVTransferConfig(kv_connector="NoSuchConnector", kv_role="kv_both"))

    assert "did you mean" not in str(caught.value)
