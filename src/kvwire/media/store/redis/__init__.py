"""The Redis medium: one key per entry on a Redis/Valkey server or cluster (`medium`)."""

from kvwire.media.store.redis._cluster import RedisClusterBlockStore
from kvwire.media.store.redis._settings import RedisStoreSettings
from kvwire.media.store.redis._store import RedisBlockStore
from kvwire.media.store.redis.medium import RedisMedium

__all__ = ["RedisBlockStore", "RedisClusterBlockStore", "RedisMedium", "RedisStoreSettings"]
