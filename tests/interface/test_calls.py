"""The interface's calls by side name every call of the base, and `forward_calls` passes them on."""

from __future__ import annotations

import abc
import inspect
from typing import Any
from unittest import mock

import pytest

from kvwire.interface.base import KVConnectorBase, SupportsHMA
from kvwire.interface.calls import INTERFACE_CALLS, CallSide, calls_on, forward_calls

# What a connector keeps of its own: what it was built with, its bound metadata.
_OWN = {
    "role",
    "engine_config",
    "kv_transfer_config",
    "kv_cache_config",
    "has_connector_metadata",
    "_get_connector_metadata",
    "_cache_hit_source",
    "_abc_impl",
}


def _declared_calls() -> set[str]:
    return {
        name
        for name in (*dir(KVConnectorBase), *vars(SupportsHMA))
        if not (name.startswith("__") and name.endswith("__")) and name not in _OWN
    }


def test_every_call_the_base_declares_has_its_side_and_nothing_else_does() -> None:
    assert set(INTERFACE_CALLS) == _declared_calls()


def test_the_class_level_calls_are_the_bases_classmethods() -> None:
    classmethods = {
        name
        for name in _declared_calls()
        if isinstance(inspect.getattr_static(KVConnectorBase, name, None), classmethod)
    }

    assert set(calls_on(CallSide.CLASS)) == classmethods


def test_a_name_outside_the_interface_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(ValueError, match=r"^not calls of the connector interface: start_load$"):
        forward_calls(["start_load_kv", "start_load"], to=lambda _connector, _call: None)


class _Target:
    """The object calls are passed on to, as `to` returns it."""

    def __init__(self) -> None:
        self.other = mock.Mock()


def _to_other(connector: _Target, call: str) -> Any:
    return connector.other


@forward_calls(["wait_for_save", "get_finished", "requires_kv_delivery"], to=_to_other)
class _Forwarding(_Target):
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return {"own"}, None


def test_a_passed_on_call_reaches_the_target_and_keeps_the_bases_name_and_signature() -> None:
    connector = _Forwarding()

    assert connector.wait_for_save() is connector.other.wait_for_save.return_value  # type: ignore[attr-defined]
    connector.other.wait_for_save.assert_called_once_with()
    assert connector.requires_kv_delivery is connector.other.requires_kv_delivery  # type: ignore[attr-defined]
    method = vars(_Forwarding)["wait_for_save"]
    assert method.__qualname__ == "_Forwarding.wait_for_save"
    assert method.__doc__ == KVConnectorBase.wait_for_save.__doc__
    assert inspect.signature(method) == inspect.signature(KVConnectorBase.wait_for_save)


def test_the_classs_own_method_is_kept() -> None:
    connector = _Forwarding()

    assert connector.get_finished(set()) == ({"own"}, None)
    connector.other.get_finished.assert_not_called()


def test_a_call_passed_on_is_no_longer_abstract() -> None:
    @forward_calls(calls_on(CallSide.SCHEDULER, CallSide.WORKER, CallSide.BOTH), to=_to_other)
    class Passing(KVConnectorBase, SupportsHMA):
        pass

    assert inspect.isabstract(Passing) is False
    assert isinstance(Passing, abc.ABCMeta)
