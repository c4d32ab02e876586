"""`kvwire check` refuses what a connector's start refuses for the profile's model."""

from __future__ import annotations

import io
import pathlib

import pytest

from kvwire.cli import check_profile

# Two float32 layers of 2 KV heads of 16, 16-token blocks: 8192 bytes a block, 8320 with its header.
MODEL = """\
model_config: {num_layers: 2, num_attention_heads: 4, num_kv_heads: 2, head_size: 16,
               intermediate_size: 128, vocab_size: 512, max_model_len: 2048, dtype: float32}
cache_config: {block_size: 16, num_gpu_blocks: 64}
"""


def check(tmp_path: pathlib.Path, text: str) -> tuple[int, str, str]:
    path = tmp_path / "profile.yaml"
    path.write_text(MODEL + text)
    out, err = io.StringIO(), io.StringIO()
    status = check_profile(str(path), out=out, err=err)
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
