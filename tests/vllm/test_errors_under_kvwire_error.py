"""kvwire.vllm's exception classes derive from KVWireError too (tests/core cannot import it)."""

from __future__ import annotations

from kvwire.exceptions import KVWireError
from tests.core.test_errors_under_kvwire_error import kvwire_exception_classes


def test_every_exception_kvwire_defines_with_vllm_derives_from_kvwire_error() -> None:
    classes = kvwire_exception_classes()
    assert "kvwire.vllm.config_bridge" in {cls.__module__ for cls in classes}
    outside = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in classes
        if not issubclass(cls, KVWireError)
    )
    assert outside == []
