"""Media: where block connectors keep KV blocks (a CPU pool, a directory, Redis), each a plug-in.

What a medium author needs is importable from here: the interface
([`Medium`][kvwire.media.Medium] and its two halves), the key-value store base
([`StoreMedium`][kvwire.media.StoreMedium] over a [`BlockStore`][kvwire.media.BlockStore]), the
typed `kv_connector_extra_config` keys a medium declares, and the errors a store raises. Importing
this package imports neither torch nor any built-in medium.
"""

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer
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
from kvwire.media.base import (
    JobResult,
    Medium,
    MediumContext,
    MediumIndex,
    TransferHandler,
    TransferJob,
    TransferKind,
)
from kvwire.media.store.base import BlockStore, CacheWrites
from kvwire.media.store.medium import StoreMedium

__all__ = [
    "BlockLayout",
    "BlockStore",
    "BlockTransfer",
    "CacheGroup",
    "CacheWrites",
    "CorruptBlockError",
    "ExtraConfigKey",
    "JobAbandoned",
    "JobResult",
    "LateWriteError",
    "Medium",
    "MediumContext",
    "MediumIndex",
    "StoreMedium",
    "TransferHandler",
    "TransferJob",
    "TransferKind",
    "ValueRefused",
    "bool_key",
    "int_key",
    "memory_size_key",
    "seconds_key",
    "size_key",
    "str_key",
]
