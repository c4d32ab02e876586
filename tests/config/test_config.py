"""The configuration records: vLLM's fields, defaults and errors."""

from __future__ import annotations

import uuid
from typing import Any

import attrs
import pytest

from kvwire.config import KVTransferConfig, SchedulerConfig
from kvwire.config.kv_cache import FullAttentionSpec, SlidingWindowSpec

ROLES = "('kv_producer', 'kv_consumer', 'kv_both')"


def test_kv_transfer_config_has_the_reference_defaults() -> None:
    config = KVTransferConfig()

    assert config.kv_connector is None
    assert config.kv_buffer_size == 1e9
    assert config.kv_role is None
    assert config.kv_rank is None
    assert config.kv_parallel_size == 1
    assert config.kv_ip == "127.0.0.1"
    assert config.kv_port == 14579
    assert config.kv_connector_extra_config == {}
    assert config.kv_connector_module_path is None
    assert config.kv_load_failure_policy == "recompute"
    uuid.UUID(config.engine_id)


def test_an_engine_id_given_is_kept() -> None:
    assert KVTransferConfig(engine_id="engine-a").engine_id == "engine-a"


def test_an_unsupported_role_names_the_supported_ones() -> None:
    with pytest.raises(ValueError) as caught:
        KVTransferConfig(kv_role="producer")  # type: ignore[arg-type]

    assert str(caught.value) == f"Unsupported kv_role: producer. Supported roles are {ROLES}"


def test_a_connector_needs_a_role() -> None:
    with pytest.raises(ValueError) as caught:
        KVTransferConfig(kv_connector="X")

    assert str(caught.value) == (
        f"Please specify kv_role when kv_connector is set, supported roles are {ROLES}"
    )


def test_an_unsupported_load_failure_policy_names_the_supported_ones() -> None:
    with pytest.raises(ValueError) as caught:
        KVTransferConfig(kv_load_failure_policy="retry")  # type: ignore[arg-type]

    assert str(caught.value) == (
        "Unsupported kv_load_failure_policy: 'retry'. Supported policies are ('recompute', 'fail')"
    )


@pytest.mark.parametrize(
    ("role", "producer", "consumer"),
    [("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)],
)
def test_producer_and_consumer_follow_the_role(role: str, producer: bool, consumer: bool) -> None:
    config = KVTransferConfig(kv_connector="X", kv_role=role)  # type: ignore[arg-type]

    assert (config.is_kv_producer, config.is_kv_consumer) == (producer, consumer)


def test_get_from_extra_config_falls_back_to_the_default() -> None:
    config = KVTransferConfig(kv_connector_extra_config={"present": 1})

    assert config.get_from_extra_config("present", 0) == 1
    assert config.get_from_extra_config("absent", 7) == 7


def test_configs_are_frozen_and_edited_by_evolve() -> None:
    config = SchedulerConfig()

    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.max_num_seqs = 3  # type: ignore[misc]
    assert attrs.evolve(
        config, disable_hybrid_kv_cache_manager=True
    ).disable_hybrid_kv_cache_manager


def test_page_size_counts_keys_and_values_of_one_block() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")

    assert spec.page_size_bytes == 2 * 16 * 2 * 64 * 2


def test_a_sliding_window_spec_has_the_same_page_size_arithmetic() -> None:
    spec = SlidingWindowSpec(
        block_size=8, num_kv_heads=1, head_size=4, dtype="float32", sliding_window=128
    )

    assert spec.page_size_bytes == 2 * 8 * 1 * 4 * 4


def test_a_value_of_the_wrong_type_is_named_by_its_type_alone() -> None:
    with pytest.raises(TypeError) as caught:
        KVTransferConfig(kv_port="x" * 1_000_000)  # type: ignore[arg-type]

    assert str(caught.value) == "kv_port must be an integer, got a str"


def test_a_nul_byte_in_a_module_path_is_refused_by_its_field() -> None:
    with pytest.raises(ValueError) as caught:
        KVTransferConfig(kv_connector_module_path="plugins.x\x00")

    assert str(caught.value) == (
        "kv_connector_module_path contains a NUL byte (\\x00), which no name may hold"
    )


def test_the_repr_of_a_huge_extra_config_is_bounded() -> None:
    config = KVTransferConfig(kv_connector_extra_config={"blob": "x" * 1_000_000})

    assert len(repr(config)) < 1000
    assert "... (a dict of 1 keys)" in repr(config)


def test_an_extra_config_sharing_a_list_a_billion_times_is_checked_at_once() -> None:
    shared: list[Any] = ["x"] * 9
    for _ in range(9):
        shared = [shared] * 9  # 9**10 strings, 91 distinct lists

    with pytest.raises(ValueError) as caught:
        KVTransferConfig(kv_connector_extra_config={"shared": shared, "path": "/kv\x00"})
    config = KVTransferConfig(kv_connector_extra_config={"shared": shared})

    assert str(caught.value).startswith("kv_connector_extra_config.path contains a NUL byte")
    assert len(repr(config)) < 1000


def test_a_connector_name_of_a_megabyte_is_refused_by_its_length() -> None:
    with pytest.raises(ValueError) as caught:
        KVTransferConfig(kv_connector="C" * 1_000_000, kv_role="kv_both")

    assert str(caught.value) == "kv_connector must be at most 4096 characters, got 1000000"


@pytest.mark.parametrize("layer_types", ["full_attention", 3, {"full_attention": 1}])
def test_layer_types_that_are_not_a_list_name_the_field_and_the_kinds(layer_types: Any) -> None:
    from kvwire.config import ModelConfig

    with pytest.raises(
        TypeError, match="layer_types must be a list of full_attention, sliding_attention, got a"
    ):
        ModelConfig(layer_types=layer_types)
