"""`kvwire check` refuses what a connector's start refuses for the profile's model."""

from __future__ import annotations

import io
import pathlib

import pytest

from kvwire.cli import check_profile
from kvwire.registry import ConnectorRegistry

# Two float32 layers of 2 KV heads of 16, 16-token blocks: 8192 bytes a block, 8320 with its header.
MODEL = """\
model_config: {num_layers: 2, num_attention_heads: 4, num_kv_heads: 2, head_size: 16,
               intermediate_size: 128, vocab_size: 512, max_model_len: 2048, dtype: float32}
cache_config: {block_size: 16, num_gpu_blocks: 64}
"""


def sample_registry() -> ConnectorRegistry:
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    registry.register_connector("SomeConnector", "tests.support.connectors", "RecordingConnector")
    return registry


def check(
    tmp_path: pathlib.Path, text: str, registry: ConnectorRegistry | None = None
) -> tuple[int, str, str]:
    path = tmp_path / "profile.yaml"
    path.write_text(MODEL + text)
    out, err = io.StringIO(), io.StringIO()
    status = check_profile(str(path), registry=registry, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.torch
def test_a_cpu_pool_that_holds_no_block_is_refused_with_the_smallest_size(
    tmp_path: pathlib.Path,
) -> None:
    status, out, err = check(
        tmp_path,
        "kv_transfer_config:\n"
        "  kv_connector: CPUOffloadConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config: {cpu_pool_bytes: 8319}\n",
    )

    assert (status, out) == (1, "")
    assert err.endswith(
        "error: kv_connector_extra_config.cpu_pool_bytes: 8319 bytes hold no block; expected at "
        "least 8320 (one block of every layer plus its header)\n"
    )


@pytest.mark.torch
def test_a_cpu_pool_of_one_block_is_accepted(tmp_path: pathlib.Path) -> None:
    status, out, _ = check(
        tmp_path,
        "kv_transfer_config:\n"
        "  kv_connector: CPUOffloadConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config: {cpu_pool_bytes: 8320}\n",
    )

    assert status == 0
    assert out.endswith("ok\n")


@pytest.mark.torch
def test_a_composites_child_pool_that_holds_no_block_is_refused_by_its_path(
    tmp_path: pathlib.Path,
) -> None:
    status, _, err = check(
        tmp_path,
        "kv_transfer_config:\n"
        "  kv_connector: MultiConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    connectors:\n"
        "      - {kv_connector: CPUOffloadConnector,\n"
        "         kv_connector_extra_config: {cpu_pool_bytes: 1KiB}}\n",
    )

    assert status == 1
    assert err.endswith(
        "error: kv_transfer_config.kv_connector_extra_config.connectors[0]: "
        "kv_connector_extra_config.cpu_pool_bytes: 1024 bytes hold no block; expected at least "
        "8320 (one block of every layer plus its header)\n"
    )


def test_a_tensor_parallel_size_that_does_not_divide_the_kv_heads_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    # Before any connector module is imported: torch-free.
    status, _, err = check(
        tmp_path,
        "parallel_config: {tensor_parallel_size: 3}\n"
        "kv_transfer_config: {kv_connector: SomeConnector, kv_role: kv_both}\n",
        registry=sample_registry(),
    )

    assert status == 1
    assert err.endswith(
        "error: parallel_config.tensor_parallel_size: 3 does not divide "
        "model_config.num_kv_heads (2); expected a divisor of 2\n"
    )


@pytest.mark.torch
def test_a_split_engines_pool_is_checked_against_one_ranks_share(tmp_path: pathlib.Path) -> None:
    # Two tensor-parallel ranks each hold one of the two KV heads: 4096 bytes a block, 4224
    # with its header, as kvwire run's rank connectors are built.
    text = (
        "parallel_config: {tensor_parallel_size: 2}\n"
        "kv_transfer_config:\n"
        "  kv_connector: CPUOffloadConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config: {cpu_pool_bytes: %d}\n"
    )

    assert check(tmp_path, text % 4224)[0] == 0
    status, _, err = check(tmp_path, text % 4223)
    assert status == 1
    assert err.endswith(
        "4223 bytes hold no block; expected at least 4224 (one block of every "
        "layer plus its header)\n"
    )
