"""A RedisConnector whose lookups are followed at once by an eviction of what they found.

It stands for another client (or the server's eviction policy) removing keys
between the scheduler's lookup and the worker's load. Loaded by module path
(``kv_connector_module_path``), as any third-party connector would be.
"""

from __future__ import annotations

import redis

from kvwire.connectors.offload import RedisConnector
from kvwire.interface.types import Request
from kvwire.media.store.redis import RedisMedium


class EvictingRedisConnector(RedisConnector):
    """After each lookup, deletes the last block the lookup counted from the server."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        matched, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if matched:
            first = num_computed_tokens // self.layout.block_size
            last_found = first + matched // self.layout.block_size - 1
            medium = self.medium
            assert isinstance(medium, RedisMedium)
            key = medium.store.redis_key(medium.store_key(request.block_hashes[last_found]))
            with redis.Redis.from_url(medium.settings.url) as client:
                client.delete(key)
        return matched, is_async
