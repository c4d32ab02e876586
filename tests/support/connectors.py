"""Connector classes the registry, container and CLI tests resolve, build and shut down.

Complete samples that record their lifecycle, and connectors whose class hooks
fail as a plug-in's can. Imports no torch: the torch-free tests use it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
from dependency_injector import providers

from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.container import KVConnectorContainer
from kvwire.interface.base import (
    ConnectorBuilder,
    HMAResolver,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from kvwire.interface.types import ForwardContext, KVCacheBlocks, Request, SchedulerOutput
from kvwire.registry import ConnectorRegistry
from kvwire.testing import IdleConnector

if TYPE_CHECKING:
    # The media need the torch extra; this module does not.
    from kvwire.media.base import Medium

# Sample connectors: small but complete (every abstract call implemented),
# defined here because the registry, the container and the CLI must be
# testable without any built-in connector. Each records its lifecycle in
# ``events`` so the tests can see what happened.

# The module path a profile names the connectors of this module by.
SAMPLES = __name__


class StepMetadata(KVConnectorMetadata):
    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids


class RecordingConnector(KVConnectorBase):
    """A connector that serves one KV cache group and records each call it gets."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.events: list[str] = []
        self.shutdown_count = 0

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.events.append("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.events.append(f"wait_for_layer_load {layer_name}")

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.events.append(f"save_kv_layer {layer_name}")

    def wait_for_save(self) -> None:
        self.events.append("wait_for_save")

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.events.append(f"update_state_after_alloc {request.request_id}")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return StepMetadata([item.request_id for item in scheduler_output.scheduled])

    def shutdown(self) -> None:
        self.shutdown_count += 1
        self.events.append("shutdown")


class HMAConnector(RecordingConnector, SupportsHMA):
    """A connector that serves several KV cache groups."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


def child_engine_configs(engine_config: EngineConfig) -> list[EngineConfig]:
    """One engine config per child in ``kv_connector_extra_config["connectors"]``."""
    parent = engine_config.kv_transfer_config
    assert parent is not None
    return [
        attrs.evolve(engine_config, kv_transfer_config=config)
        for config in child_transfer_configs(parent)
    ]


def child_transfer_configs(parent: KVTransferConfig) -> list[KVTransferConfig]:
    children = parent.get_from_extra_config("connectors", None) or []
    return [
        KVTransferConfig(**{"engine_id": parent.engine_id, "kv_role": parent.kv_role, **child})
        for child in children
    ]


class CompositeConnector(RecordingConnector, SupportsHMA):
    """Forwards to children named in its extra config, built through the connector builder."""

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        connector_builder: ConnectorBuilder,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.children = [
            connector_builder(child, role, kv_cache_config)
            for child in child_engine_configs(config)
        ]

    @classmethod
    def supports_hma_for_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: HMAResolver
    ) -> bool:
        children = child_transfer_configs(kv_transfer_config)
        return bool(children) and all(resolve_child(child) for child in children)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()
        super().shutdown()


class CompositeSubclass(CompositeConnector):
    """A composite under another name: its HMA support still depends on its children."""


class TwoArgumentConnector(RecordingConnector):
    """A plugin written for the old 2-argument constructor."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:  # type: ignore[override]
        raise AssertionError("the signature check must stop this class before it is built")


class VarKeywordConnector(RecordingConnector):
    """Accepts ``kv_cache_config`` only through ``**kwargs``: allowed by vLLM."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


NOT_A_CLASS = 42


# Connectors whose class hooks fail as a plug-in's can: each named after how.
#
# Their messages quote a secret; ``kvwire check``, ``kvwire run`` and the
# engine must name the hook and show the message redacted, never a traceback.

LEAKY_MESSAGE = "lost redis://u:hunter2-secret@h"


class RaisingHMAHookConnector(IdleConnector):
    """Its ``supports_hma_for_config`` raises a RuntimeError."""

    @classmethod
    def supports_hma_for_config(cls, config: Any, resolve: Callable[[Any], bool]) -> bool:
        raise RuntimeError(LEAKY_MESSAGE)


class ExitingHMAHookConnector(IdleConnector):
    """Its ``supports_hma_for_config`` calls ``sys.exit()``."""

    @classmethod
    def supports_hma_for_config(cls, config: Any, resolve: Callable[[Any], bool]) -> bool:
        sys.exit(LEAKY_MESSAGE)


class ExitingValidationConnector(IdleConnector):
    """Its ``validate_extra_config`` calls ``sys.exit()``."""

    @classmethod
    def validate_extra_config(cls, config: Any, resolve: Callable[[Any], Any]) -> None:
        sys.exit(LEAKY_MESSAGE)


class ExitingConstructorConnector(IdleConnector):
    """Its constructor calls ``sys.exit()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        sys.exit(LEAKY_MESSAGE)


def read_options(
    connector_class: type[KVConnectorBase],
    kv_transfer_config: KVTransferConfig,
    *,
    registry: ConnectorRegistry | None = None,
) -> tuple[type[Medium], dict[str, Any]]:
    """The medium class and the options a container reads for ``connector_class`` from
    ``kv_transfer_config`` (its ``medium_class`` and ``medium_options`` providers)."""
    container = KVConnectorContainer()
    if registry is not None:
        container.registry.override(providers.Object(registry))
    container.kv_transfer_config.override(providers.Object(kv_transfer_config))
    container.connector_class.override(providers.Object(connector_class))
    medium_class = container.medium_class()
    options = container.medium_options()
    assert medium_class is not None and options is not None
    return medium_class, options
