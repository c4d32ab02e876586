"""The Redis tests' fixtures: real redis-server processes and clusters on free loopback ports."""

from __future__ import annotations

from tests.support.redis import (
    expected_tokens,
    fault_cluster,
    fault_server,
    fault_server_process,
    key_prefix,
    make_redis_store,
    redis_cluster,
    redis_server,
    redis_server_process,
    redis_store,
    tls_url,
    workload,
)

__all__ = [
    "expected_tokens",
    "fault_cluster",
    "fault_server",
    "fault_server_process",
    "key_prefix",
    "make_redis_store",
    "redis_cluster",
    "redis_server",
    "redis_server_process",
    "redis_store",
    "tls_url",
    "workload",
]
