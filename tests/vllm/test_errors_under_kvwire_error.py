"""kvwire.vllm's errors derive from KVWireError too, and its public names resolve
(tests/exceptions cannot import it)."""

from __future__ import annotations

import sys

import kvwire.vllm
from kvwire.exceptions import KVWireError
from tests.exceptions.test_errors_under_kvwire_error import kvwire_exception_classes
from tests.package import test_public_surface as public_surface


def test_every_exception_kvwire_defines_with_vllm_derives_from_kvwire_error() -> None:
    classes = kvwire_exception_classes()
    # The walk imported the modules that need vLLM.
    assert "kvwire.vllm.connector" in sys.modules
    outside = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in classes
        if not issubclass(cls, KVWireError)
    )
    assert outside == []


def test_every_error_of_the_vllm_adapter_is_defined_in_kvwire_exceptions() -> None:
    # The same check as tests/exceptions's, here where the vLLM adapter's modules import.
    public_surface.test_every_public_exception_kvwire_defines_is_defined_in_kvwire_exceptions()


def test_every_public_name_of_kvwire_vllm_resolves() -> None:
    missing = [name for name in kvwire.vllm.__all__ if getattr(kvwire.vllm, name, None) is None]

    assert missing == []
