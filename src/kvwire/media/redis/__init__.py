"""The Redis medium: one key per entry on a Redis/Valkey server or cluster (:mod:`.medium`)."""

from kvwire.media.redis._cluster import RedisClusterBlockStore
from kvwire.media.redis._settings import RedisStoreSettings
from kvwire.media.redis._store import RedisBlockStore
from kvwire.media.redis.medium import RedisMedium

__all__ = ["RedisBlockStore", "RedisClusterBlockStore", "RedisMedium", "RedisStoreSettings"]
