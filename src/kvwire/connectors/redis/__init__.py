"""The Redis/Valkey connector: KV blocks shared by engines on many machines.

The block connector (:mod:`kvwire.connectors.offload`) over the Redis medium
(:mod:`kvwire.media.store.redis.medium`, whose docstring lists its
``kv_connector_extra_config`` keys, a single server or a Redis Cluster, and
what happens in an outage), beside the connector's own ``async_load``.
"""

from __future__ import annotations

from kvwire.connectors.offload import OffloadConnector

__all__ = ["RedisConnector"]


class RedisConnector(OffloadConnector):
    """Saves and loads KV blocks in a Redis/Valkey server, one key per block."""

    default_medium = "redis"
