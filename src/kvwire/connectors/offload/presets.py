"""The offload connector with a medium chosen: the names profiles and vLLM configurations use.

Each is `OffloadConnector` with
its `default_medium` set, and takes that medium's
`kv_connector_extra_config` keys (listed in the medium's docstring) beside
the connector's own `async_load`; `medium` still picks another.
"""

from __future__ import annotations

from kvwire.connectors.offload.connector import OffloadConnector

__all__ = [
    "CPUOffloadConnector",
    "RedisConnector",
    "SharedStorageConnector",
    "TieredOffloadConnector",
]


class CPUOffloadConnector(OffloadConnector):
    """Offloads full KV blocks to a preallocated CPU pool and loads them back; kvwire's default.

    The medium is `kvwire.media.cpu_pool.medium` (`cpu_pool_bytes`,
    `io_threads`, `transfer_timeout_s`): the scheduler half owns the
    pool's index and decides every slot, the worker half owns the pool
    memory and copies. A saved block becomes visible to lookups once its
    request is reported finished sending.
    """

    default_medium = "cpu_pool"


class SharedStorageConnector(OffloadConnector):
    """Saves and loads KV blocks as files under `shared_storage_path`, a directory engines share.

    The medium is `kvwire.media.store.directory.medium` (`shared_storage_path`,
    `fsync`, `max_bytes`, `file_mode`, `allow_other_owner`, and the
    store keys of `kvwire.media.store.medium`).
    """

    default_medium = "directory"


class RedisConnector(OffloadConnector):
    """Saves and loads KV blocks in a Redis/Valkey server or cluster, one key per block.

    The medium is `kvwire.media.store.redis.medium`, whose docstring lists its keys
    (a single server or a Redis Cluster) and what happens in an outage.
    """

    default_medium = "redis"


class TieredOffloadConnector(OffloadConnector):
    """A CPU pool in front of slower tiers (shared storage, Redis, ...): it decides what goes where.

    Each secondary tier is any kvwire medium.

    The medium is `kvwire.media.tiered.medium`: the CPU pool's keys
    (`cpu_pool_bytes`, `eviction`, `save_threshold`, ...), `write_policy`
    (`write_through` or `spill`) and `tiers`, a list of secondary tiers,
    each a medium's name under `medium` with that medium's keys. A block
    found in a secondary tier is brought into the pool on its way to the
    cache; the tiers are written from the pool's memory.
    """

    default_medium = "tiered"
