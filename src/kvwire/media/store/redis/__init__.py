"""The Redis medium (`medium`): one key per entry on a Redis/Valkey server or cluster.

The stores beneath it: `server` (one server) and `cluster` (a Redis Cluster's masters).
"""

from kvwire.media.store.redis.cluster import RedisClusterBlockStore
from kvwire.media.store.redis.medium import RedisMedium
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings

__all__ = ["RedisBlockStore", "RedisClusterBlockStore", "RedisMedium", "RedisStoreSettings"]
