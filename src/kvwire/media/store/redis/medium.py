"""The Redis medium: one key per entry on a Redis/Valkey server or cluster, shared by many machines.

Engines on different hosts share blocks through a Redis (or Valkey) server
they already run. The data path is every store medium's
(`kvwire.media.store.medium`: background I/O threads, every entry
verified before its block is reported loaded); the store is
`RedisBlockStore` (`RedisClusterBlockStore` for a cluster),
which sends a block's bytes to the server straight from the KV cache and
scatters a loaded one straight into it (no staging copy on either side).

`kv_connector_extra_config` keys, beside the common ones of
`kvwire.media.StoreMedium` (see
`RedisStoreSettings`):

- `url`: `redis://host:port/db`, `rediss://` (TLS) or `unix:///path`
  for one server; `redis+cluster://host:port[,host:port...]` (or
  `rediss+cluster://`) for a Redis Cluster or Valkey cluster (see below);
- `username`, `password` or `password_env` (the name of an environment
  variable holding it: keeps the secret out of profiles), `db`;
- `key_prefix` (default `kvwire:`), `ttl_seconds` (default: no expiry; a
  load restarts a block's TTL, so blocks in use stay and idle ones expire);
- `pool_size`, `socket_timeout_s` (one read or write),
  `connect_timeout_s` (connecting, and then the handshake in all),
  `lookup_batch_size`;
- `load_timeout_s` (default 20), `save_timeout_s` (default 30) and
  `lookup_timeout_s` (default 1; also deletes, the reconnect probe and each
  step of a cache reset): how long one call may take in all. A lookup runs
  on the scheduler's thread, which waits for it no longer than that even
  when the server hangs (it is made on a thread of the store's). The socket
  timeout bounds each read, not a reply: without these, a server answering a
  byte every few seconds would hold a load, and the engine waiting for it,
  forever. Past its deadline a call fails as in an outage (below): the
  blocks of a load not yet read are load errors, computed again, and the
  connection, left mid-reply, is dropped. A load is one run of blocks, so
  `load_timeout_s` must cover the largest run at the network's speed;
- `pipeline_bytes` (default 64 MiB): the most one connection has in flight.
  A save sends its SETs in pipelines of at most this many bytes; a load asks
  for its GETs in groups of 4 MiB (or half of this, if smaller) and asks for
  the next group as soon as the current one is answered, so the server runs
  the next GETs while the worker verifies and scatters. Replies waiting in
  the server count toward its `maxmemory`: on a server at its limit with
  an eviction policy, they make it evict that much more (a block evicted
  between lookup and load is a load error, computed again);
- `retry_interval_s` (during an outage, how often a background probe asks the server),
  `warning_interval_s` (at most one outage warning per interval);
- `tls_ca_certs`, `tls_certfile`, `tls_keyfile`, `tls_verify`.

Every duration is a finite number of seconds up to a bound: 1 hour for the
timeouts and `retry_interval_s`, 1 day for `warning_interval_s`, 3650 days
for `ttl_seconds` (docs/profiles.md lists them all). Past it, or infinite,
it would overflow the socket calls and deadlines it sets, so `kvwire check`
and the engine refuse it.

When the server is down, lookups miss, saves are dropped and loads are
reported as load errors; the engine's outputs stay those of an engine
without a connector, and the store reconnects by itself when the server is
back. Beside the store media's counters, the stats report
`redis_lookup_failures`, `redis_saves_dropped` (outage),
`redis_saves_rejected` (e.g. out of memory under `noeviction`),
`redis_load_failures` (outage or deadline), `redis_loads_oversized` (a
value longer than its entry: refused from its length, never read into memory,
warned about and deleted like a corrupt entry) and `redis_loads_refused`
(e.g. `NOPERM`), each only when not zero.

A cluster URL names seed nodes: any node of the cluster, the URL's
credentials used for every node (what redis-py's `RedisCluster` is given as
`startup_nodes`; one that answers is enough). Keys are spread over every
master by hash slot, so `key_prefix` may hold no `{hash tag}`, and there is
no database but 0. Each call sends each master its keys (same pipelines,
zero-copy reads, deadlines, `pool_size` connections per master), the masters
in parallel (see `kvwire.media.store.redis.cluster`). When a master
dies, its keys are misses, dropped saves or load errors (the other masters'
keys still hit) until its replica takes over; the store then finds the new
master by itself (it asks for the slot map every `retry_interval_s` while a
master is down, and at once on `MOVED`), and those keys hit again if the
replica had them. Slots moved between masters (resharding) are followed the
same way; no call ever waits for a new map.

KV cache events (medium `redis`): `BlockStored` for the blocks a save stored,
`BlockRemoved` for corrupt or too-long values a load found and deleted (so they
stop being hits for every engine). Entries the server drops by itself
(`ttl_seconds` expiry, `maxmemory` eviction under an `allkeys-*`/`volatile-*`
policy) are never seen by the connector, so no `BlockRemoved` reports them: a
router may think such a block is still held, and the lookup then simply misses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from kvwire.config.extra_config import ExtraConfigError, ExtraConfigKey
from kvwire.media.base import MediumContext
from kvwire.media.store.medium import StoreMedium
from kvwire.media.store.redis.cluster import RedisClusterBlockStore
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisSettingsError, RedisStoreSettings

__all__ = ["RedisBlockStore", "RedisClusterBlockStore", "RedisMedium", "RedisStoreSettings"]


@attrs.frozen
class _Given:
    """A Redis key's raw value, passed through to `RedisStoreSettings` to validate."""

    value: Any = attrs.field(repr=False)


_NOT_GIVEN: Any = None
# Not a declared key, so a user's extra config can never supply it.
_SETTINGS = "redis_settings"


def _redis_key(name: str) -> ExtraConfigKey:
    # The store's settings validate these keys together (a URL and a db may
    # conflict) and without echoing a password, so here every value is only
    # wrapped; the generic reader would reject a legitimate null.
    return ExtraConfigKey(name, _NOT_GIVEN, _Given, "see RedisStoreSettings")


class RedisMedium(StoreMedium[RedisBlockStore | RedisClusterBlockStore]):
    """KV blocks in a Redis/Valkey server (or cluster), one key per entry."""

    event_medium: ClassVar[str] = "redis"

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        self._redis: RedisBlockStore | RedisClusterBlockStore | None = None

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return (
            *super().extra_config_keys(),
            *(_redis_key(name) for name in RedisStoreSettings.extra_config_keys()),
        )

    @classmethod
    def finish_options(cls, connector_name: str, options: dict[str, Any]) -> dict[str, Any]:
        """The common options, and the Redis ones as `options["redis_settings"]`.

        Only checks: no server is asked, so `kvwire check` runs it too. A
        `password_env` that names an unset variable is an error here, as
        the medium could not authenticate without it.
        """
        options = super().finish_options(connector_name, options)
        given = {name: value.value for name, value in options.items() if isinstance(value, _Given)}
        try:
            settings = RedisStoreSettings.from_extra_config(given)
        except RedisSettingsError as error:
            raise ExtraConfigError(f"{connector_name}: {error}") from None
        return {**options, _SETTINGS: settings}

    @property
    def settings(self) -> RedisStoreSettings:
        """The validated Redis settings."""
        settings: RedisStoreSettings = self.context.options[_SETTINGS]
        return settings

    def create_store(self, options: Mapping[str, Any]) -> RedisBlockStore | RedisClusterBlockStore:
        """A cluster store for a cluster URL, else a single server's."""
        settings: RedisStoreSettings = options[_SETTINGS]
        self._redis = (
            RedisClusterBlockStore(settings) if settings.is_cluster else RedisBlockStore(settings)
        )
        return self._redis

    @property
    def redis_store(self) -> RedisBlockStore | RedisClusterBlockStore:
        """The Redis store itself, under whatever a subclass wrapped it in."""
        self.store  # noqa: B018 - creates it on first use
        assert self._redis is not None, "create_store did not build the Redis store"
        return self._redis

    def store_counters(self) -> Mapping[str, float]:
        return self.redis_store.take_counters()

    def late_write_grace_s(self) -> float:
        # A read under way ends within the socket timeout, which may be set above the default grace.
        return max(super().late_write_grace_s(), 2 * self.settings.socket_timeout_s)

    def reset_store(self) -> bool:
        """Forget this engine's blocks, of every KV cache group, under the key prefix.

        Other layouts' blocks stay. False when the server could not be asked
        (an outage): blocks may have stayed.
        """
        store = self.redis_store
        for layout in self.stored_layouts:
            store.clear(under=layout.fingerprint_hex)
        return store.is_available
