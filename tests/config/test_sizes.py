"""Absurd sizes and counts are refused by name, in ``kvwire check`` and at start.

A size beyond what this machine can hold (100 TiB of staging, a KV cache of
a billion blocks) or a count no model has (100,000 layers) must fail when
the configuration is read, naming the field and the bytes, never later as a
``MemoryError`` or ``OverflowError`` traceback.
"""

from __future__ import annotations

import io
import pathlib

import pytest

from kvwire.cli import check_profile
from kvwire.config import KVTransferConfig, ModelConfig
from kvwire.config.extra_config import ExtraConfigError, parse_size
from kvwire.config.kv_cache import build_full_attention_kv_cache_config
from kvwire.config.memory_limits import describe_bytes, machine_memory_bytes, memory_shortfall
from kvwire.config.profile import load_profile
from kvwire.container import container_for_profile
from kvwire.exceptions import ProfileError
from kvwire.interface.base import KVConnectorRole
from tests.support.connectors import read_options

HUNDRED_TIB = 100 * 1024**4
THREE_HUNDRED_DIGITS = int("9" * 300)


def check(tmp_path: pathlib.Path, text: str) -> tuple[int, str]:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    status = check_profile(str(path), out=out, err=err)
    return status, err.getvalue()


def connector_profile(connector: str, extra_config: str) -> str:
    return (
        "kv_transfer_config:\n"
        f"  kv_connector: {connector}\n"
        "  kv_role: kv_both\n"
        f"  kv_connector_extra_config: {extra_config}\n"
    )


def test_the_machine_memory_is_known_and_plausible() -> None:
    memory = machine_memory_bytes()

    assert memory is not None
    assert 64 * 1024**2 < memory < HUNDRED_TIB


def test_a_size_that_fits_has_no_shortfall() -> None:
    assert memory_shortfall(1024) is None


def test_a_size_beyond_the_machine_says_how_much_there_is() -> None:
    shortfall = memory_shortfall(HUNDRED_TIB)

    assert shortfall == f"more than this machine's memory, {describe_bytes(machine_memory_bytes())}"  # type: ignore[arg-type]


def test_bytes_are_described_with_a_unit_and_exactly() -> None:
    assert describe_bytes(1536 * 1024**2) == "1.5 GiB (1,610,612,736 bytes)"


def test_an_absurd_byte_count_is_described_by_its_size_alone() -> None:
    assert describe_bytes(THREE_HUNDRED_DIGITS) == "about 2**996 bytes"


@pytest.mark.torch
@pytest.mark.parametrize(
    ("connector", "key"),
    [
        # The store connectors' max_save_bytes_in_flight allocates nothing (it bounds
        # the bytes of saves in flight): only the CPU pool is memory.
        ("CPUOffloadConnector", "cpu_pool_bytes"),
    ],
)
def test_check_refuses_a_buffer_larger_than_the_machine(
    tmp_path: pathlib.Path, connector: str, key: str
) -> None:
    extra = f"{{{key}: 100TiB}}"

    status, error = check(tmp_path, connector_profile(connector, extra))

    assert status == 1
    assert (
        f"kv_connector_extra_config.{key}: 100.0 TiB (109,951,162,777,600 bytes) would be "
        f"allocated in memory, more than this machine's memory, "
    ) in error


def test_a_size_of_300_digits_is_refused_by_name_in_the_profile(tmp_path: pathlib.Path) -> None:
    status, error = check(
        tmp_path, connector_profile("CPUOffloadConnector", f"{{cpu_pool_bytes: {'9' * 300}}}")
    )

    assert status == 1
    assert "line 4, column 47: an integer of 300 digits; no setting takes more than 40" in error


@pytest.mark.torch
def test_a_size_of_300_digits_from_a_mapping_is_refused_by_name() -> None:
    transfer = KVTransferConfig(
        kv_connector="CPUOffloadConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_pool_bytes": THREE_HUNDRED_DIGITS},
    )
    from kvwire.connectors.offload import CPUOffloadConnector

    with pytest.raises(ExtraConfigError) as caught:
        read_options(CPUOffloadConnector, transfer)

    assert str(caught.value).startswith(
        "kv_connector_extra_config.cpu_pool_bytes: <an integer of about 300 digits> is not "
        "accepted by CPUOffloadConnector"
    )


def test_a_size_string_too_long_to_be_a_float_is_unreadable_not_an_overflow() -> None:
    assert parse_size("9" * 30 + "TiB") == int("9" * 30) * 1024**4
    assert parse_size("9" * 300 + "TiB") is None


@pytest.mark.torch
def test_the_connector_refuses_a_buffer_larger_than_the_machine_at_start() -> None:
    kv_cache_config = build_full_attention_kv_cache_config(
        num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=16, dtype="float32"
    )
    container = container_for_profile(
        {
            "kv_transfer_config": {
                "kv_connector": "CPUOffloadConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_pool_bytes": "100TiB"},
            }
        },
        role=KVConnectorRole.WORKER,
        kv_cache_config=kv_cache_config,
    )

    with pytest.raises(ExtraConfigError, match=r"^kv_connector_extra_config\.cpu_pool_bytes: 100"):
        container.connector()


def test_a_kv_cache_larger_than_the_machine_is_refused_naming_its_fields() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile(
            {"model_config": {"num_layers": 80}, "cache_config": {"num_gpu_blocks": 10**8}}
        )

    (problem,) = caught.value.problems
    memory = describe_bytes(machine_memory_bytes())  # type: ignore[arg-type]
    assert problem.startswith(
        "model_config, cache_config, scheduler_config: the engine needs at least 29.8 TiB "
        f"(32,768,013,107,200 bytes), more than this machine's memory, {memory}. "
        "The KV cache (2 x num_layers 80 x num_gpu_blocks 100000000 x block_size 16 x "
        "num_kv_heads 2 x head_size 16 x 4 bytes of float32): 29.8 TiB (32,768,000,000,000 bytes)"
    )


def test_weights_larger_than_the_machine_are_refused() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile(
            {
                "model_config": {
                    "num_layers": 1024,
                    "num_attention_heads": 1024,
                    "num_kv_heads": 8,
                    "head_size": 128,
                    "intermediate_size": 2**16,
                },
                "cache_config": {"num_gpu_blocks": 1},
            }
        )

    assert "the weights: 225.0 TiB (247,390,653,120,512 bytes)" in caught.value.problems[0]


def test_a_batch_whose_logits_exceed_the_machine_is_refused() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile(
            {
                "model_config": {"vocab_size": 2**20},
                "scheduler_config": {"max_num_batched_tokens": 2**20},
            }
        )

    assert caught.value.problems[0].endswith(
        "a batch's logits (max_num_batched_tokens 1048576 x vocab_size 1048576 x 4 bytes): "
        "4.0 TiB (4,398,046,511,104 bytes)"
    )


@pytest.mark.parametrize(
    ("section", "field", "value", "limit"),
    [
        ("model_config", "num_layers", 100_000, 1024),
        ("model_config", "num_attention_heads", 10**6, 4096),
        ("model_config", "num_kv_heads", 10**6, 4096),
        ("model_config", "head_size", 10**6, 4096),
        ("model_config", "vocab_size", 10**9, 2**24),
        ("model_config", "max_model_len", 10**9, 2**24),
        ("cache_config", "block_size", 10**6, 2**16),
        ("scheduler_config", "max_num_seqs", 10**9, 2**20),
        ("scheduler_config", "max_num_batched_tokens", 10**9, 2**24),
        ("parallel_config", "world_size", 10**9, 2**16),
    ],
)
def test_a_count_beyond_any_real_model_is_refused_by_name(
    section: str, field: str, value: int, limit: int
) -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile({section: {field: value}})

    assert caught.value.problems == (
        f"{section}.{field}: {field} must be <= {limit} (far more than any real model uses), "
        f"got {value}",
    )


def test_a_seed_outside_the_generators_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^seed must be between -9223372036854775808 and "):
        ModelConfig(seed=2**64)


def test_an_infinite_kv_buffer_size_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_buffer_size must be a finite number, got inf"):
        KVTransferConfig(kv_buffer_size=float("inf"))


def test_a_kv_buffer_size_too_large_for_a_float_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^kv_buffer_size is too large, got <an integer of"):
        KVTransferConfig(kv_buffer_size=10**400)


def test_a_kv_buffer_size_that_is_not_a_number_is_refused_by_name_and_bounded() -> None:
    with pytest.raises(ValueError) as raised:
        KVTransferConfig(kv_buffer_size="9" * 1000 + "x")

    assert str(raised.value).startswith("kv_buffer_size must be a number, got '999")
    assert len(str(raised.value)) < 200


def test_a_kv_buffer_size_of_the_wrong_type_is_a_type_error_naming_the_field() -> None:
    with pytest.raises(TypeError, match=r"^kv_buffer_size must be a number, got None$"):
        KVTransferConfig(kv_buffer_size=None)
