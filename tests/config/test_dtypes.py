"""The one dtype table: every module agrees with it, and stored codes never change."""

from __future__ import annotations

import struct

import pytest
import torch

from kvwire.blocks.format import HEADER_SIZE, BlockLayout, write_header
from kvwire.config import ModelConfig
from kvwire.config.dtypes import DTYPE_NAMES, DTYPES
from kvwire.config.kv_cache import FullAttentionSpec
from kvwire.engine.model import torch_dtype

pytestmark = pytest.mark.torch

# The dtype code every entry header on a store already carries: changing one
# would make old entries unreadable (or worse, read as another dtype).
STORED_CODES = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
}
_DTYPE_CODE = struct.Struct("<H")
_DTYPE_CODE_OFFSET = 6  # after the 4-byte magic and the 2-byte format version


@pytest.mark.parametrize("name", sorted(STORED_CODES))
def test_an_entry_header_carries_the_dtype_code_it_always_had(name: str) -> None:
    layout = BlockLayout(num_layers=1, block_size=2, num_kv_heads=1, head_size=4, dtype=name)
    entry = memoryview(bytearray(layout.entry_bytes))
    write_header(entry, layout, b"h" * 32)
    (code,) = _DTYPE_CODE.unpack_from(entry, _DTYPE_CODE_OFFSET)
    assert code == STORED_CODES[name] == DTYPES[name].code
    assert layout.payload_bytes == 2 * 2 * 4 * DTYPES[name].size
    assert HEADER_SIZE + layout.payload_bytes == layout.entry_bytes


def test_the_table_holds_exactly_the_stored_dtypes_with_torch_element_sizes() -> None:
    assert set(DTYPE_NAMES) == set(STORED_CODES)
    for name, dtype in DTYPES.items():
        assert dtype.name == name
        assert dtype.torch_dtype().itemsize == dtype.size
        assert ModelConfig(dtype=name).dtype_size == dtype.size


@pytest.mark.parametrize(
    "build",
    [
        lambda value: ModelConfig(dtype=value),
        lambda value: FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=value),
    ],
    ids=["ModelConfig", "AttentionSpec"],
)
def test_an_unknown_dtype_is_refused_naming_the_field_and_accepted_names(build: object) -> None:
    accepted = "float32, float16, bfloat16, float8_e4m3fn, float8_e5m2"
    with pytest.raises(ValueError, match=rf"^dtype: 'fp64' is not one of {accepted}$"):
        build("fp64")  # type: ignore[operator]


def test_the_engine_computes_in_the_table_s_engine_dtypes_only() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(
        ValueError,
        match=r"model_config.dtype: 'float8_e5m2' is not supported by the kvwire engine; "
        r"use one of float32, float16, bfloat16$",
    ):
        torch_dtype("float8_e5m2")
