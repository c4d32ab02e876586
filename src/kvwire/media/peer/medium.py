"""The peer medium: engines read each other's CPU pools over NIXL, found through a directory.

Each engine keeps the blocks it saves in a CPU pool of its own, as the CPU
pool medium does, and exposes that pool to a NIXL agent. Once a save
completed, the engine announces its blocks in a *directory* kept in a
Redis/Valkey server or a Redis Cluster (`kvwire.media.peer._directory`):
block key -> this peer, the slot, the slot's generation. Any engine of the same model
and layout then finds a block by its hash, whichever peer holds it, and
its worker pulls the entry straight from that peer's memory with a NIXL
read, verifies it and scatters it into its KV cache. No store holds KV
in between, and no router passes transfer parameters: disaggregated
prefill is a `kv_producer` and a `kv_consumer` given the same prompt,
and any group of `kv_both` engines pools its CPU memory into one cache.

Bytes that move under a reader are never loaded (see
`kvwire.media.peer._handler`): every pulled entry is verified before
it reaches the cache, a failed read is a load error (computed again) and
withdraws the directory entries it relied on, and a read never outlives
`transfer_timeout_s`. Peers of another model, dtype or layout never
match: the layout fingerprint names every directory entry.

`kv_connector_extra_config` keys:

- `url` and the Redis medium's other connection keys (`password_env`,
  `key_prefix`, `socket_timeout_s`, TLS...; see
  `RedisStoreSettings`): the directory's server:
  one server (`redis://`, `rediss://`, `unix://`), or a Redis Cluster
  (`redis+cluster://`, `rediss+cluster://`), each entry and peer record on
  the master of its slot, such as the one a Redis medium of the same job uses;
- `lookup_timeout_s` (default 1), `retry_interval_s` (default 1) and
  `warning_interval_s` (default 30): no directory call (a lookup, an
  announcement, a withdrawal, a peer record) waits longer than
  `lookup_timeout_s`, on a hung server too; one that fails or is not
  answered by then starts an outage, during which calls answer at once
  (lookups miss) until a probe, every `retry_interval_s`, is answered.
  The announcements and withdrawals the outage held back are made at the
  first scheduler step after it (see `kvwire.media.peer._index`);
- `cpu_pool_bytes` (default `"256MiB"`), `io_threads` (default 2) and
  `transfer_timeout_s` (default 30): the pool's, as for the CPU pool
  medium; `transfer_timeout_s` also bounds each load, pulls included;
- `peer_name` (default `kvwire-<engine_id>`): this peer's name in the
  directory and its NIXL agent's (each rank's, with ` rank<r>` added,
  when the engine is split); unique among the peers;
- `staging_blocks` (default 64): entries each load thread pulls at once;
- `directory_ttl_s` (default 3600): a directory entry's expiry;
- `peer_heartbeat_s` (default 5): how often a worker refreshes its peer
  record, which expires after three of these unrefreshed: readers then
  stop trying a peer that died.

NIXL's transport is UCX's to choose: on hosts without RDMA, set
`UCX_TLS=tcp,self,sm` (add `UCX_NET_DEVICES=lo` for loopback only).
Install the `peer` extra (`nixl-cu12`, which runs without CUDA).

Split engines (tensor and pipeline parallelism; `kvwire.media.peer._split`):
each rank keeps its share of a block (its KV heads, its stage's layers) in
its own pool, in the slot the scheduler half gave the block (the same on
every rank), behind its own NIXL agent and peer record, named
`<peer_name> rank<r>`; the scheduler half announces the block once. A
reader's rank `r` pulls from the holder's rank `r`. The directory names
entries by the whole split, so engines split differently (TP=1 and TP=2,
PP=1 and PP=2) find none of each other's blocks: a miss, computed, never
a load of another split's bytes. A block is announced once every rank
reported its save ended (a share a rank failed to write is refused by the
reader), and a pull failed on one rank fails the block on every rank
(computed again there).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from kvwire.blocks.format import BlockLayout
from kvwire.config.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    int_key,
    seconds_key,
    str_key,
)
from kvwire.interface.counters import Counters
from kvwire.media.base import Medium, MediumContext, MediumIndex, TransferHandler
from kvwire.media.cpu_pool import CPUPoolMedium
from kvwire.media.cpu_pool.medium import eviction_policy, save_admission
from kvwire.media.peer._agent import nixl_missing
from kvwire.media.peer._directory import PeerDirectory, check_peer_name
from kvwire.media.peer._index import PeerIndex
from kvwire.media.peer._split import rank_layout, split_fingerprints
from kvwire.media.store.redis import RedisMedium
from kvwire.media.store.redis.settings import RedisStoreSettings

if TYPE_CHECKING:
    import torch

__all__ = ["PeerMedium"]

logger = logging.getLogger(__name__)

# The Redis keys that say nothing about the directory (they size blocks' values).
_UNUSED_REDIS_KEYS = ("ttl_seconds", "pipeline_bytes", "lookup_batch_size")
_DIRECTORY = "peer_directory_settings"


class PeerMedium(Medium):
    """Blocks in this engine's CPU pool, readable by every peer; any peer's, readable here."""

    event_medium: ClassVar[str] = "peer"
    found_by_key: ClassVar[bool] = False

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        self._pool_shape = CPUPoolMedium(context)
        self.num_slots = self._pool_shape.num_slots
        options = context.options
        given = options["peer_name"]
        self.peer_name: str = given if given is not None else _default_name(context.engine_id)
        try:
            self._rank_layout = rank_layout(context.layout, context.parallel, context.parallel.rank)
        except ValueError as error:
            raise ExtraConfigError(f"{context.connector_name}: {error}") from None
        # The directory names each block once for every rank: by the whole split.
        self.directory_names = split_fingerprints(self.group_layouts, context.parallel)

    @property
    def layout(self) -> BlockLayout:
        """This rank's share of a block, its heads and layers named when the engine is split."""
        return self._rank_layout

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        redis_keys = tuple(
            key for key in RedisMedium.extra_config_keys() if _is_directory_key(key.name)
        )
        return (
            *CPUPoolMedium.extra_config_keys(),
            *redis_keys,
            str_key("peer_name", None),
            int_key("staging_blocks", 64, minimum=1, maximum=65536),
            seconds_key("directory_ttl_s", 3600.0, maximum=30 * 24 * 3600),
            seconds_key("peer_heartbeat_s", 5.0, maximum=3600),
        )

    @classmethod
    def finish_options(cls, connector_name: str, options: dict[str, Any]) -> dict[str, Any]:
        """NIXL installed, the directory's Redis settings checked (no connection), the peer name."""
        missing = nixl_missing()
        if missing is not None:
            # Here rather than when the worker starts its agent: `kvwire check` refuses it too.
            raise missing
        redis_names = set(RedisStoreSettings.extra_config_keys())
        given = {
            name: getattr(value, "value", value)
            for name, value in options.items()
            if name in redis_names and _is_directory_key(name)
        }
        given = {name: value for name, value in given.items() if value is not None}
        try:
            settings = RedisStoreSettings.from_extra_config(given)
        except ValueError as error:
            raise ExtraConfigError(f"{connector_name}: {error}") from None
        name = options.get("peer_name")
        if name is not None and (problem := check_peer_name(name)) is not None:
            raise ExtraConfigError(
                f"{connector_name}: kv_connector_extra_config.peer_name: expected {problem}"
            )
        return {**options, _DIRECTORY: settings}

    def _directory(self) -> PeerDirectory:
        options = self.context.options
        return PeerDirectory(options[_DIRECTORY], options["directory_ttl_s"])

    def build_index(self) -> MediumIndex:
        return PeerIndex(
            num_slots=self.num_slots,
            fingerprints=self.directory_names,
            medium=self.event_medium,
            peer=self.peer_name,
            directory=self._directory(),
            policy=eviction_policy(self.context, self.num_slots),
            admission=save_admission(self.context.options["save_threshold"], self.num_slots),
        )

    def build_handler(
        self, kv_caches: Mapping[str, torch.Tensor], counters: Counters
    ) -> TransferHandler:
        # Imported here: they need torch and NIXL, which the scheduler half never imports.
        from kvwire.blocks.paged_cache import group_caches
        from kvwire.media.peer._handler import PeerTransferHandler, PeerTransferSettings

        context, options = self.context, self.context.options
        handler = PeerTransferHandler(
            layouts=self.group_layouts,
            directory_names=self.directory_names,
            caches=group_caches(kv_caches, context.layout, context.groups),
            num_slots=self.num_slots,
            counters=counters,
            directory=self._directory(),
            settings=PeerTransferSettings(
                peer=self.peer_name,
                parallel=context.parallel,
                staging_blocks=options["staging_blocks"],
                io_threads=options["io_threads"],
                transfer_timeout_s=options["transfer_timeout_s"],
                heartbeat_s=options["peer_heartbeat_s"],
            ),
        )
        logger.info(
            "%s: peer %r (rank %d) exposes a pool of %d blocks (%.1f MiB) over NIXL",
            context.connector_name,
            self.peer_name,
            context.parallel.rank,
            self.num_slots,
            self.num_slots * self.layout.entry_bytes / 2**20,
        )
        return handler


def _is_directory_key(name: str) -> bool:
    return name not in _UNUSED_REDIS_KEYS and name in RedisStoreSettings.extra_config_keys()


def _default_name(engine_id: str) -> str:
    # engine_id is shared by both roles and every process of one engine; an
    # engine built without one gets a name of its own.
    name = f"kvwire-{engine_id or uuid.uuid4()}"
    return name if check_peer_name(name) is None else f"kvwire-{uuid.uuid4()}"
