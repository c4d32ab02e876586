"""Builds a MultiConnector, its children through the default registry as in service."""

from __future__ import annotations

from typing import Any

from kvwire.connectors.multi import MultiConnector
from kvwire.interface.base import KVConnectorRole
from tests.support.connector_pairs import build_connector, cache_config_for, engine_config


def build_multi(role: KVConnectorRole, extra: dict[str, Any]) -> MultiConnector:
    """The ``role`` side of a MultiConnector whose extra config is ``extra``."""
    config = engine_config("MultiConnector", extra)
    return build_connector(MultiConnector, config, role, cache_config_for(config))
