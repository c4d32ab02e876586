"""Store media: each block one entry in a `kvwire.media.BlockStore`.

A store medium names each block's entry by key; the store finds it by key
alone, so the scheduler half's index only asks the store how many
consecutive blocks it holds (`BlockStore.count_prefix`: only a prefix that
is really present counts) and decides nothing else. The worker half's
handler (`StoreTransferHandler`) moves blocks straight between the KV
cache's block ranges and the store (an entry is the `block_format` header,
then every layer's block), on background threads:
the forward pass only submits. A loaded entry is verified where it landed,
in the cache, before its block counts as loaded; a block that fails is a
load error, which the engine computes again.

## How a medium supplies its store

Subclass `kvwire.media.StoreMedium` and implement
`kvwire.media.StoreMedium.create_store`; declare
your own `kv_connector_extra_config` keys by extending
`kvwire.media.StoreMedium.extra_config_keys`
(and check them together, or derive values, in
`kvwire.media.StoreMedium.finish_options`). The
store is created once per medium object, when its first half is built, with the
validated options:

```python
class MyMedium(StoreMedium[MyStore]):
    event_medium = "mystore"

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return (*super().extra_config_keys(), str_key("url", None, required=True))

    def create_store(self, options: Mapping[str, Any]) -> MyStore:
        return MyStore(options["url"])
```

Optionally override `kvwire.media.StoreMedium.store_key` (the
default is `group_layouts[group].key(block_hash)`: the KV cache group's layout
fingerprint + block hash; override
`kvwire.media.StoreMedium.block_hash_of`, its inverse,
with it), `kvwire.media.StoreMedium.store_counters`
(extra stats from your store),
`kvwire.media.StoreMedium.reset_store` (forget this
engine's entries) and
`kvwire.media.StoreMedium.start_sweeper` /
`kvwire.media.StoreMedium.stop_sweeper` (the
sweeper: the worker half's own background work, such as a sweep), and give
your store a `discard(keys)` so entries found corrupt stop being hits. The
store must never raise into the engine: misses and failures are results.

Hybrid models (several KV cache groups): an entry holds one block of every
layer of one group, keyed and headed with that group's layout (its name is
in the fingerprint), so two groups' entries for one block hash never share a
key and one never loads into the other. With a single group the keys are
those of earlier versions. `store_key(block_hash)` overrides written for
one group keep working with one group; a hybrid engine calls
`store_key(block_hash, group)`, and refuses at construction an override
that cannot take `group`.

KV cache events (`event_medium` names the store in them): the worker half
reports `BlockStored` for the blocks each save really stored (not the
dropped or failed ones) and `BlockRemoved` for the corrupt entries it
discarded and for those the store's `take_removed_keys` reports (a size
cap).

Common `kv_connector_extra_config` keys of every store medium:

- `max_save_bytes_in_flight` (default 64 MiB: the bytes of entries that
  saves in flight may hold, nothing allocated; a save beyond it is dropped
  and counted, never waited for);
- `io_threads` (default 4, per direction);
- `batch_blocks` (default 8: blocks per save job, and the shortest load
  run: a load is shared between the I/O threads in runs of at least this
  many blocks, one store call each);
- `transfer_timeout_s` (default 30: the deadline of each load and save,
  from its start; a load still running then is abandoned and its blocks are
  load errors, which the engine computes again, and never writes into the
  cache afterwards; a save still running then counts failed);
- `entry_kv_heads` (KV heads per entry; default: a rank's heads, all of
  them at tensor-parallel size 1): each block is one entry per group of that
  many heads, named apart, so engines of different tensor-parallel sizes
  that set it alike share entries (see `kvwire.blocks.shards`); a
  lookup counts a block only when every group's entry is stored;
- `entry_layers` (layers per entry; default: a pipeline stage's layers,
  all of them without pipeline parallelism): the same for layers, so
  engines of different pipeline-parallel sizes that set it alike share
  entries;
- `mac_key_env` (the name of an environment variable holding a MAC key:
  every entry is then sealed with HMAC-SHA256 and one whose MAC does not
  match is a load error, see `kvwire.blocks.mac`; the key itself is
  never accepted in a profile).

The connector declares `async_load` (loads reported through
`get_finished`) itself.
"""

from __future__ import annotations

import abc
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import attrs

from kvwire.blocks.format import BlockLayout, block_of_key
from kvwire.blocks.mac import EntryMac, MacKeyError
from kvwire.blocks.shards import entry_layout, plan_heads, plan_layers
from kvwire.common.plugin_calls import call_plugin
from kvwire.config.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    int_key,
    seconds_key,
    size_key,
)
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash
from kvwire.media.base import Medium, MediumContext, MediumIndex, TransferHandler
from kvwire.media.store._entry_keys import EntryKeys, LayoutKeys
from kvwire.media.store.base import LATE_WRITE_GRACE_S, BlockStore

if TYPE_CHECKING:
    import torch

    from kvwire.blocks.memory import BlockMemory

__all__ = ["StoreMedium"]

logger = logging.getLogger(__name__)

# Not a declared key, so a user's extra config can never supply it.
_ENTRY_MAC = "entry_mac"

_Store = TypeVar("_Store", bound=BlockStore)


@attrs.frozen
class _Unchecked:
    """`mac_key_env` as given: checked by
    `kvwire.media.StoreMedium.finish_options`, never echoed.

    The generic reader would print a bad value, and a bad value here may be
    the key itself.
    """

    value: object = attrs.field(repr=False)


class StoreMedium(Medium, Generic[_Store]):
    """A medium that keeps encoded KV blocks in a `kvwire.media.BlockStore`, one entry
    per block.

    Abstract: a subclass supplies the store through
    `kvwire.media.StoreMedium.create_store` (`_Store` is its type). The store is
    created once per medium object, by whichever half is built first; the halves built close it, the
    last one to close closing the store (a connector builds one half, so that half owns it).
    """

    # A subclass names its store ("disk", "redis"); one that does not is
    # "store" in its events, as store-backed connectors always were.
    event_medium: ClassVar[str] = "store"

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        # Both sides: sealed entries are named apart (the key's id is in the fingerprint).
        mac: EntryMac | None = context.options[_ENTRY_MAC]
        self._layout = attrs.evolve(context.layout, mac=mac)
        # Once: keys and headers index these, never rebuild them.
        self._group_layouts = tuple(
            attrs.evolve(layout, mac=mac) for layout in super().group_layouts
        )
        self._heads = plan_heads(
            self._layout.num_kv_heads, context.parallel, context.options.get("entry_kv_heads")
        )
        self._layer_plans = tuple(
            plan_layers(group.layer_names, context.parallel, context.options.get("entry_layers"))
            for group in context.groups
        )
        # Per KV cache group, the entries of one block, as (layers, heads):
        # this rank's (what its worker half moves) and every rank's (what a
        # lookup asks for). One each, the group's own, for an unsplit engine.
        self._own_entries = tuple(
            tuple((layers, heads) for layers in plan.own for heads in self._heads.own)
            for plan in self._layer_plans
        )
        self._own_entry_layouts = tuple(
            tuple(entry_layout(layout, heads, layers) for layers, heads in entries)
            for layout, entries in zip(self._group_layouts, self._own_entries, strict=True)
        )
        self._every_entry_layouts = tuple(
            tuple(
                entry_layout(layout, heads, layers)
                for layers in plan.every
                for heads in self._heads.every
            )
            for layout, plan in zip(self._group_layouts, self._layer_plans, strict=True)
        )
        self._whole = all(len(entries) == 1 for entries in self._every_entry_layouts)
        self._key_of = self._group_key_function()
        self._store: _Store | None = None
        self._store_users = 0

    # ------------------------------------------------------- subclass hooks

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        """The common store keys (see the module); a subclass adds its own."""
        return (
            # Allocates nothing (a bound on saves in flight): no memory check.
            size_key("max_save_bytes_in_flight", 64 * 1024**2),
            int_key("io_threads", 4, minimum=1, maximum=64),
            int_key("batch_blocks", 8, minimum=1, maximum=4096),
            seconds_key("transfer_timeout_s", 30.0, maximum=24 * 3600),
            int_key("entry_kv_heads", None, minimum=1, counts="KV heads per entry"),
            int_key("entry_layers", None, minimum=1, counts="layers per entry"),
            ExtraConfigKey(
                "mac_key_env",
                None,
                _Unchecked,
                "the name of an environment variable holding a MAC key",
            ),
        )

    @classmethod
    def finish_options(cls, connector_name: str, options: dict[str, Any]) -> dict[str, Any]:
        """The options, and the MAC keyed from `mac_key_env` as `options["entry_mac"]`.

        An unset, empty or too short variable is an error here, so `kvwire
        check` (run in the engine's environment) finds it before the engine.
        A subclass that extends this calls it.
        """
        given = options["mac_key_env"]
        try:
            entry_mac = None if given is None else EntryMac.from_environment(given.value)
        except MacKeyError as error:
            raise ExtraConfigError(f"kv_connector_extra_config.mac_key_env: {error}") from None
        return {**options, _ENTRY_MAC: entry_mac}

    @abc.abstractmethod
    def create_store(self, options: Mapping[str, Any]) -> _Store:
        """The store this medium uses, from the validated extra-config `options`."""

    def store_key(self, block_hash: BlockHash, group: int = 0) -> str:
        """The store key of a block of KV cache `group`: its layout's fingerprint, then the hash.

        With a single group, the key is `layout.key(block_hash)`, the key
        of a model without groups. An override for hybrid engines must take `group`
        (see the module).
        """
        return self._group_layouts[group].key(block_hash)

    def block_hash_of(self, key: str) -> BlockHash | None:
        """The block hash `kvwire.media.StoreMedium.store_key` made `key` from, in any
        group; None for another's."""
        found = block_of_key(self._group_layouts, key)
        return None if found is None else found[0]

    def block_group_of(self, key: str) -> int | None:
        """The KV cache group whose layout made `key`; None for another's.

        A medium that overrides `kvwire.media.StoreMedium.store_key` and
        `kvwire.media.StoreMedium.block_hash_of` overrides this too, or its events
        name no group.
        """
        found = block_of_key(self._group_layouts, key)
        return None if found is None else found[1]

    def store_counters(self) -> Mapping[str, float]:
        """Extra counters from the store since the last call, reported with the stats."""
        return {}

    def late_write_grace_s(self) -> float:
        """How long a given-up load's read already under way may take to return.

        Longer than any single read the store can make: past it the engine
        stops (`LateWriteError`) rather than let the read land late. A
        store whose reads are bounded by a longer timeout raises it.
        """
        return LATE_WRITE_GRACE_S

    def reset_store(self) -> bool | None:
        """Forget this engine's entries; True when done, False if some stayed, None if unknown."""
        return None

    def start_sweeper(self, handler: TransferHandler) -> None:
        """Start the sweeper, the worker half's own background work, once `handler` is built.

        A sweep of what the store holds (the directory medium's start-up
        sweep of dead writers' files), off the forward pass's thread; none by
        default.
        """

    def stop_sweeper(self) -> None:
        """Stop what `kvwire.media.StoreMedium.start_sweeper` started.

        Called at close, before the store closes.
        """

    # ------------------------------------------------------------- the store

    @property
    def layout(self) -> BlockLayout:
        """The layout of one entry of any group, sealed with the MAC when there is one."""
        return self._layout

    @property
    def group_layouts(self) -> tuple[BlockLayout, ...]:
        """Each KV cache group's entry layout, sealed with the MAC when there is one."""
        return self._group_layouts

    @property
    def stored_layouts(self) -> tuple[BlockLayout, ...]:
        """The layouts of every entry this engine's ranks store, of every group and head group.

        What a reset removes; with a single group of whole blocks,
        `kvwire.media.StoreMedium.group_layouts`.
        """
        return tuple(layout for group in self._every_entry_layouts for layout in group)

    @property
    def store(self) -> _Store:
        """The store, created on first use from the context's options."""
        if self._store is None:
            self._store = call_plugin(
                "kv_connector_extra_config.medium",
                f"{type(self).__name__}.create_store",
                lambda: self.create_store(self.context.options),
            )
        return self._store

    def _open_store(self) -> _Store:
        """The store, for one more half that closes it through `_release_store`."""
        store = self.store
        self._store_users += 1
        return store

    def _release_store(self) -> None:
        """A half closed: close the store once no half uses it."""
        self._store_users -= 1
        if self._store_users == 0 and self._store is not None:
            self._store.close()

    def _group_key_function(self) -> Callable[[int, BlockHash], str]:
        """How this medium names a block of a group: through
        `kvwire.media.StoreMedium.store_key`, overrides too.

        A single-group engine calls `store_key(block_hash)`, so an override
        written before groups existed keeps its keys; a hybrid engine needs
        one that takes `group`.
        """
        groups = self.context.groups
        if not self._whole:
            if type(self).store_key is not StoreMedium.store_key:
                raise TypeError(
                    f"{type(self).__name__} overrides store_key, and this engine stores "
                    "entries of groups of KV heads or layers (tensor or pipeline parallelism, "
                    "entry_kv_heads, entry_layers): their keys are their layouts' (the heads "
                    "and layers are in the fingerprint)"
                )
            return lambda group, block_hash: self._group_layouts[group].key(block_hash)
        if len(groups) == 1:
            return lambda group, block_hash: self.store_key(block_hash)
        try:
            inspect.signature(self.store_key).bind(b"", 0)
        except TypeError:
            raise TypeError(
                f"{type(self).__name__}.store_key takes only a block hash, and this "
                f"kv_cache_config has {len(groups)} KV cache groups; expected "
                "store_key(block_hash, group), naming each group's blocks apart "
                "(or set disable_hybrid_kv_cache_manager: true)"
            ) from None
        return lambda group, block_hash: self.store_key(block_hash, group)

    # ----------------------------------------------------------------- halves

    def build_index(self) -> MediumIndex:
        """The scheduler half: lookups by key in the store; it owns closing the store."""
        if self._whole:
            key_of = self._key_of

            def entry_keys(group: int, block_hashes: Sequence[BlockHash]) -> list[str]:
                return [key_of(group, block_hash) for block_hash in block_hashes]

            per_block = 1
        else:
            every = self._every_entry_layouts

            def entry_keys(group: int, block_hashes: Sequence[BlockHash]) -> list[str]:
                # Block after block, each block's head groups in a row: the
                # store's prefix of present keys ends at the first block one
                # of whose entries is missing.
                return [layout.key(h) for h in block_hashes for layout in every[group]]

            per_block = len(every[0])
        return _StoreIndex(
            self._open_store(), entry_keys, per_block, self.reset_store, self._release_store
        )

    def build_handler(
        self, kv_caches: Mapping[str, torch.Tensor], counters: Counters
    ) -> TransferHandler:
        """The worker half: a `StoreTransferHandler` over the caches, which closes the store.

        The caches are checked against the groups before the store is opened.
        A rank that stores entries of groups of KV heads gets the worker
        behind a `HeadGroupsHandler`.
        """
        # Imported here: they need torch, which the scheduler half never imports.
        from kvwire.blocks.memory import BlockMemory, group_memories
        from kvwire.blocks.paged_cache import group_caches
        from kvwire.media.store._handler import StoreTransferHandler
        from kvwire.media.store._head_groups import HeadGroupsHandler

        options = self.context.options
        groups = self.context.groups
        # At least one block's save may be in flight, whatever the bound.
        max_save_bytes = max(options["max_save_bytes_in_flight"], self._layout.entry_bytes)
        if self._whole:
            layouts: Sequence[BlockLayout] = self._group_layouts
            memories: Sequence[BlockMemory] = group_memories(kv_caches, self._layout, groups)
            keys: EntryKeys = _MediumKeys(self)
        else:
            # The worker's groups are (KV cache group, entry of a block)
            # pairs, in that order; HeadGroupsHandler turns a cache group's
            # transfer into its.
            group_caches(kv_caches, self._layout, groups)
            own = self._own_entries[0]
            layouts = [layout for group in self._own_entry_layouts for layout in group]
            memories = []
            for group, plan, entries in zip(
                groups, self._layer_plans, self._own_entries, strict=True
            ):
                for layers, heads in entries:
                    names = group.layer_names[plan.local(layers).start : plan.local(layers).stop]
                    memories.append(
                        BlockMemory(
                            {name: kv_caches[name] for name in names},
                            attrs.evolve(self._layout, num_layers=len(names)),
                            names,
                            heads=self._heads.local(heads),
                        )
                    )
            keys = LayoutKeys(layouts, per_cache_group=len(own))

        worker = StoreTransferHandler(
            store=self._open_store(),
            layouts=layouts,
            memories=memories,
            io_threads=options["io_threads"],
            batch_blocks=options["batch_blocks"],
            max_save_bytes=max_save_bytes,
            counters=counters,
            keys=keys,
            medium=self.event_medium,
            transfer_timeout_s=options["transfer_timeout_s"],
            late_write_grace_s=self.late_write_grace_s(),
            store_counters=self.store_counters,
            on_close=self._worker_closed,
        )
        self.start_sweeper(worker)
        handler: TransferHandler = (
            worker if self._whole else HeadGroupsHandler(worker, len(self._own_entries[0]))
        )
        logger.info(
            "%s: %s store, %d KV cache group(s), blocks of %d bytes, saves in flight up to "
            "%d bytes, %d I/O threads per direction",
            self.context.connector_name,
            self.event_medium,
            len(self.context.groups),
            self._layout.payload_bytes,
            max_save_bytes,
            options["io_threads"],
        )
        return handler

    def _worker_closed(self) -> None:
        """The handler's transfers ended: stop the sweeper, release the store."""
        try:
            self.stop_sweeper()
        finally:
            self._release_store()


class _MediumKeys(EntryKeys):
    """A store medium's own key scheme:
    `kvwire.media.StoreMedium.store_key` and its inverses."""

    def __init__(self, medium: StoreMedium[Any]) -> None:
        self._medium = medium

    def key(self, group: int, block_hash: BlockHash) -> str:
        return self._medium._key_of(group, block_hash)

    def block_of(self, key: str) -> tuple[BlockHash, int | None] | None:
        block_hash = self._medium.block_hash_of(key)
        return None if block_hash is None else (block_hash, self._medium.block_group_of(key))


class _StoreIndex(MediumIndex):
    """A store medium's scheduler half: the store finds entries by key, so it only counts.

    `entry_keys(group, hashes)` names the entries of those blocks, block
    after block, `per_block` entries each (every rank's head groups).
    """

    # Lookups keep no state here: a store is called from many threads.
    concurrent_lookups = True

    def __init__(
        self,
        store: BlockStore,
        entry_keys: Callable[[int, Sequence[BlockHash]], list[str]],
        per_block: int,
        reset_store: Callable[[], bool | None],
        release_store: Callable[[], None],
    ) -> None:
        self._store = store
        self._entry_keys = entry_keys
        self._per_block = per_block
        self._reset_store = reset_store
        self._release_store = release_store

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """Only a consecutive prefix that is really in the store, under `group`'s keys, counts.

        One store call, whatever the number of entries per block; a block
        counts only when all of them are there.
        """
        held = self._store.count_prefix(self._entry_keys(group, block_hashes))
        if self._per_block == 1 or type(held) is not int:
            # Passed on as answered: the connector checks it is a count of the keys.
            return held
        return held // self._per_block

    def reset(self) -> bool | None:
        return self._reset_store()

    def close(self) -> None:
        self._release_store()
