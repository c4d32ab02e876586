"""Media: where offload connectors keep KV blocks (a CPU pool, a directory, Redis), each a plug-in.

What a medium author needs is importable from here: the interface
(`kvwire.media.Medium` and its two halves, and the typed records they pass: a
`kvwire.media.LoadSpec`, a medium's own
`kvwire.media.TransferPayload`), the key-value store base
(`kvwire.media.StoreMedium` over a `kvwire.media.BlockStore`), the
kit a transfer handler is built from (its jobs in flight: a
`kvwire.media.JobLedger` of `kvwire.media.JobPiece`s; its
`kvwire.media.IOThreads`; rate-limited warnings; a close in steps; the
`Counters` it counts in), the KV cache events a medium reports
(`kvwire.media.BlockStored`, `kvwire.media.BlockRemoved`), the
typed `kv_connector_extra_config` keys a medium declares, the
`kvwire.media.EvictionPolicy` a pool's plug-in policies derive from (handed to
a medium resolved, in its context's `plugins`), the errors a store raises,
and the `kvwire.media.BlockMemory` a handler reads and writes a group's blocks
through. Importing this package imports neither torch nor any built-in medium: `BlockMemory`,
which needs torch, is imported on first use.
"""

from typing import TYPE_CHECKING

from kvwire.blocks.format import BlockLayout, HeadShard, LayerShard
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.mac import EntryMac
from kvwire.blocks.transfers import BlockTransfer, TransferPayload
from kvwire.common.lazy_exports import lazy_exports
from kvwire.config.engine_config import ParallelConfig
from kvwire.config.extra_config import (
    ExtraConfigKey,
    bool_key,
    int_key,
    memory_size_key,
    seconds_key,
    size_key,
    str_key,
)
from kvwire.exceptions import CorruptBlockError, JobAbandoned, LateWriteError, ValueRefused
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash, BlockRemoved, BlockStored, KVCacheEvent
from kvwire.media.base import (
    JobResult,
    LoadSpec,
    Medium,
    MediumContext,
    MediumIndex,
    TransferHandler,
    TransferJob,
    TransferKind,
)
from kvwire.media.eviction import EvictionPolicy
from kvwire.media.io_threads import IOThreads
from kvwire.media.jobs import JobLedger, JobPiece, part_of
from kvwire.media.rate_limited import RateLimitedWarning
from kvwire.media.shutdown import close_in_steps
from kvwire.media.store.base import BlockStore, CacheWrites
from kvwire.media.store.medium import StoreMedium

if TYPE_CHECKING:
    from kvwire.blocks.memory import BlockMemory

__all__ = [
    "BlockHash",
    "BlockLayout",
    "BlockMemory",
    "BlockRemoved",
    "BlockStore",
    "BlockStored",
    "BlockTransfer",
    "CacheGroup",
    "CacheWrites",
    "CorruptBlockError",
    "Counters",
    "EntryMac",
    "EvictionPolicy",
    "ExtraConfigKey",
    "HeadShard",
    "IOThreads",
    "JobAbandoned",
    "JobLedger",
    "JobPiece",
    "JobResult",
    "KVCacheEvent",
    "LateWriteError",
    "LayerShard",
    "LoadSpec",
    "Medium",
    "MediumContext",
    "MediumIndex",
    "ParallelConfig",
    "RateLimitedWarning",
    "StoreMedium",
    "TransferHandler",
    "TransferJob",
    "TransferKind",
    "TransferPayload",
    "ValueRefused",
    "bool_key",
    "close_in_steps",
    "int_key",
    "memory_size_key",
    "part_of",
    "seconds_key",
    "size_key",
    "str_key",
]

# Lazy: it needs torch.
__getattr__, __dir__ = lazy_exports(globals(), {"BlockMemory": "kvwire.blocks.memory"})
