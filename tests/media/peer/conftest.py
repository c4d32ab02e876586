"""Peers for the peer medium's tests: engine processes, a real redis-server, NIXL over loopback.

The directory lives on the Redis tests' server (started by pytest-redis on a
free port); each test works under a key prefix of its own. Tests that stop
the directory's server use ``fault_server``, a server of their own. NIXL's UCX runs
over loopback TCP and shared memory: the environment is set before any
agent starts, here and in every peer process (they inherit it).
"""

from __future__ import annotations

import os

from tests.support.redis import (
    fault_server,
    fault_server_process,
    key_prefix,
    redis_cluster,
    redis_server,
    redis_server_process,
)

os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

__all__ = [
    "fault_server",
    "fault_server_process",
    "key_prefix",
    "redis_cluster",
    "redis_server",
    "redis_server_process",
]
