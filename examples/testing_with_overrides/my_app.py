"""A user's application code: it asks the container for connectors and never builds one.

``build_container`` is the application's one place of set-up; everything
else gets its connector injected, so tests can swap any part through the
container's providers (see ``test_my_app.py``).
"""

from __future__ import annotations

import sys

from dependency_injector.wiring import Provide, inject

from kvwire import KVConnectorBase, KVConnectorContainer
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.container import container_for_profile
from kvwire.interface.types import Request

PROFILE = "cpu-offload"  # a profile kvwire ships, by name


def build_container(kv_cache_config: KVCacheConfig) -> KVConnectorContainer:
    container = container_for_profile(PROFILE, kv_cache_config=kv_cache_config)
    container.wire(modules=[sys.modules[__name__]])
    return container


@inject
def tokens_to_load(
    request: Request,
    connector: KVConnectorBase = Provide[KVConnectorContainer.scheduler_connector],
) -> int:
    """How many of ``request``'s tokens the connector can load instead of computing them."""
    tokens, _ = connector.get_num_new_matched_tokens(request, request.num_computed_tokens)
    return tokens or 0


@inject
def hybrid_kv_cache_enabled(
    gate: object = Provide[KVConnectorContainer.hma_gate],
) -> bool:
    return bool(getattr(gate, "enabled", False))
