"""The dtypes a KV cache may hold, in one table: name, element size, stored code, torch dtype.

Configuration names a dtype by string, so that it never needs torch: the
torch dtype is looked up only when asked for, and a torch-free install
imports this module. The stored code goes into every entry's header
(`kvwire.blocks.format`); entries outlive the code that wrote
them, so a code, once given, never changes or gets reused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvwire.common.redaction import shown

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "KVDtype", "check_dtype"]


@attrs.frozen
class KVDtype:
    """One dtype a KV cache may hold."""

    # The name configuration uses, which is also torch's (`torch.<name>`).
    name: str
    # Bytes of one element.
    size: int
    # The entry header's code for it: fixed forever.
    code: int
    # Whether kvwire's own engine runs a model in it (it rounds every
    # sub-layer's float64 result to this dtype; float8 is moved, not computed).
    engine_computes: bool

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype; imports torch on first use."""
        import torch

        dtype: torch.dtype = getattr(torch, self.name)
        return dtype


DTYPES: Mapping[str, KVDtype] = {
    dtype.name: dtype
    for dtype in (
        KVDtype("float32", 4, 1, engine_computes=True),
        KVDtype("float16", 2, 2, engine_computes=True),
        KVDtype("bfloat16", 2, 3, engine_computes=True),
        KVDtype("float8_e4m3fn", 1, 4, engine_computes=False),
        KVDtype("float8_e5m2", 1, 5, engine_computes=False),
    )
}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)


def check_dtype(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: `value` names a dtype of the table; the error names the field."""
    if not isinstance(value, str) or value not in DTYPES:
        raise ValueError(f"{attribute.name}: {shown(value)} is not one of {', '.join(DTYPE_NAMES)}")
