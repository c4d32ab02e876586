"""Configuration: the engine's config records, and how kvwire reads, checks and sizes them.

- `kvwire.config.engine_config`: the engine's configuration as a connector sees it
  (`EngineConfig` and its parts), re-exported here;
- `kvwire.config.kv_cache`: how the sized KV cache is laid out (`KVCacheConfig`);
- `kvwire.config.profile` and `kvwire.config.profile_yaml`: profiles, an
  `EngineConfig` written as YAML or a mapping, read bounded;
- `kvwire.config.extra_config`: the keys a connector takes in
  `kv_connector_extra_config`;
- `kvwire.config.memory_limits` and `kvwire.config.dtypes`: sizes checked against
  the machine, and the dtypes a KV cache may hold.
"""

from kvwire.config.engine_config import (
    COUNT_LIMITS,
    FULL_ATTENTION,
    KV_CACHE_LAYOUTS,
    KV_CONSUMER_ROLES,
    KV_PRODUCER_ROLES,
    KV_ROLES,
    LAYER_TYPES,
    LOAD_FAILURE_POLICIES,
    LONGEST_NAME,
    SEED_RANGE,
    SLIDING_ATTENTION,
    CacheConfig,
    EngineConfig,
    KVRole,
    KVTransferConfig,
    LoadFailurePolicy,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

__all__ = [
    "COUNT_LIMITS",
    "FULL_ATTENTION",
    "KV_CACHE_LAYOUTS",
    "KV_CONSUMER_ROLES",
    "KV_PRODUCER_ROLES",
    "KV_ROLES",
    "LAYER_TYPES",
    "LOAD_FAILURE_POLICIES",
    "LONGEST_NAME",
    "SEED_RANGE",
    "SLIDING_ATTENTION",
    "CacheConfig",
    "EngineConfig",
    "KVRole",
    "KVTransferConfig",
    "LoadFailurePolicy",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
]
