"""ForwardingConnector passes every call of the connector interface on, unchanged."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from kvwire.interface.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvwire.interface.forwarding import ForwardingConnector

# What a connector keeps of its own rather than asking the wrapped one: what it was built with.
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


def _interface_calls() -> list[str]:
    return sorted(
        name
        for name in dir(KVConnectorBase)
        if not (name.startswith("__") and name.endswith("__")) and name not in _OWN
    )


def _forwarding(inner: Any, wrapped: Any) -> ForwardingConnector:
    class Forwarding(ForwardingConnector):
        pass

    Forwarding.wrapped = wrapped
    config = SimpleNamespace(kv_transfer_config=object())
    return Forwarding(config, KVConnectorRole.WORKER, object(), inner=inner)  # type: ignore[arg-type]


def test_every_call_of_the_interface_has_its_forward() -> None:
    not_forwarded = [name for name in _interface_calls() if name not in vars(ForwardingConnector)]

    assert not_forwarded == []


@pytest.mark.parametrize("name", _interface_calls())
def test_each_call_reaches_the_wrapped_connector_with_its_arguments(name: str) -> None:
    inner, wrapped = mock.Mock(), mock.Mock()
    connector = _forwarding(inner, wrapped)
    attribute = inspect.getattr_static(ForwardingConnector, name)
    if isinstance(attribute, property):
        assert getattr(connector, name) is getattr(inner, name)
        return
    is_class_level = isinstance(attribute, classmethod)
    function = attribute.__func__ if is_class_level else attribute
    parameters = list(inspect.signature(function).parameters.values())[1:]
    arguments = [
        mock.sentinel.__getattr__(p.name)
        for p in parameters
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]

    answer = getattr(connector, name)(*arguments)

    target = getattr(wrapped if is_class_level else inner, name)
    target.assert_called_once_with(*arguments)
    if answer is not None:
        assert answer is target.return_value


def test_a_wrapped_connector_without_hma_gets_the_one_groups_blocks() -> None:
    inner = mock.Mock(spec=["request_finished"])
    inner.request_finished.return_value = (True, None)
    connector = _forwarding(inner, mock.Mock())

    assert connector.request_finished_all_groups(mock.sentinel.request, ([1, 2],)) == (True, None)
    inner.request_finished.assert_called_once_with(mock.sentinel.request, [1, 2])


def test_the_wrapper_keeps_the_bound_metadata_and_the_kv_cache_manager_too() -> None:
    inner = mock.Mock()
    connector = _forwarding(inner, mock.Mock())
    metadata = KVConnectorMetadata()

    connector.bind_connector_metadata(metadata)
    connector.bind_kv_cache_manager(mock.sentinel.manager)

    assert connector.has_connector_metadata()
    assert connector._kv_cache_manager is mock.sentinel.manager
    # The wrapped connector binds the block pool itself: not twice.
    inner.bind_gpu_block_pool.assert_not_called()
    connector.clear_connector_metadata()
    assert not connector.has_connector_metadata()
    inner.clear_connector_metadata.assert_called_once_with()


def test_a_wrapper_that_wraps_the_metadata_hands_on_the_wrapped_connectors() -> None:
    class Wrapping(ForwardingConnector):
        def _inner_metadata(self, metadata: KVConnectorMetadata) -> KVConnectorMetadata:
            return metadata.inner  # type: ignore[attr-defined,no-any-return]

    inner = mock.Mock()
    config = SimpleNamespace(kv_transfer_config=object())
    connector = Wrapping(config, KVConnectorRole.WORKER, object(), inner=inner)  # type: ignore[arg-type]
    outer = SimpleNamespace(inner=mock.sentinel.inner_metadata)

    connector.bind_connector_metadata(outer)  # type: ignore[arg-type]
    connector.handle_preemptions(outer)  # type: ignore[arg-type]

    inner.bind_connector_metadata.assert_called_once_with(mock.sentinel.inner_metadata)
    inner.handle_preemptions.assert_called_once_with(mock.sentinel.inner_metadata)
