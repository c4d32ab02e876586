"""A fault-injecting medium: another medium whose chosen loads fail, to exercise recovery.

Subclass :class:`FaultInjectingMedium` and say, with class attributes, which
medium it wraps and which loads fail::

    class FailFirstDirectory(FaultInjectingMedium):
        inner = DirectoryMedium
        fail_request_ids = frozenset({"first"})
        fail_block_index = 0

For each request in ``fail_request_ids`` (every request when None), its
first load leaves garbage in one block of the loaded range, the one at
``fail_block_index`` (the range is the request's blocks of every KV cache
group, group after group; an index past either end picks the block at that
end), and that block is reported as a load error, as a medium whose load
failed would: 0xFF bytes (NaN in every float dtype) in each layer of the
block's group. A synchronous load fails once the wrapped medium's loads of
the step ended, before the connector saves the step, so the connector's own
rule leaves out the saves computed from it; an asynchronous one fails when
it is reported finished.

Everything but the worker side's transfers is the wrapped medium's: its
``kv_connector_extra_config`` keys, KV cache events, layouts and index. The
class is configured by attributes only, so a profile may name it
(``kv_connector_extra_config.medium: package.module:Class``) and a worker
process build it from that name; or a registry's medium provider may be
overridden with it (:mod:`kvwire.medium_registry`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, ClassVar

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.transfers import BlockTransfer
from kvwire.connector.counters import Counters
from kvwire.connector.types import KVCacheEvent
from kvwire.extra_config import ExtraConfigKey
from kvwire.media.base import Medium, MediumContext, MediumIndex, TransferHandler
from kvwire.redaction import shown

if TYPE_CHECKING:
    import torch

    from kvwire.blocks.memory import BlockMemory

__all__ = ["FaultInjectingHandler", "FaultInjectingMedium", "LoadFaults", "poison_block"]

POISON_BYTE = 0xFF
"""What a failed load leaves in a block: all bits set, a NaN in every float dtype."""


def poison_block(memory: BlockMemory, block_id: int) -> None:
    """Fill block ``block_id`` of every layer in ``memory`` with :data:`POISON_BYTE`."""
    for byte_range in memory.ranges(block_id):
        byte_range[:] = bytes([POISON_BYTE]) * len(byte_range)


class LoadFaults:
    """Which loads fail: each chosen request's first one, at one block of its range.

    Shared by the fault-injecting medium and the conformance kit's
    fault-injecting connector, so both fail the same block.
    """

    def __init__(self, request_ids: frozenset[str] | None, block_index: int) -> None:
        self._request_ids = request_ids
        self._block_index = block_index
        self._failed_requests: set[str] = set()

    def choose(self, request_id: str, blocks: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        """The ``(group, block id)`` of ``blocks`` to fail for this load of ``request_id``, if any.

        ``blocks`` is the loaded range, group after group. Only a chosen
        request's first load with blocks fails.
        """
        if (
            not blocks
            or request_id in self._failed_requests
            or (self._request_ids is not None and request_id not in self._request_ids)
        ):
            return None
        self._failed_requests.add(request_id)
        index = max(-len(blocks), min(self._block_index, len(blocks) - 1))
        return blocks[index]


class FaultInjectingHandler(TransferHandler):
    """The wrapped medium's transfer handler, with the chosen loads failed after they end.

    ``memories`` holds each KV cache group's blocks as byte ranges, in group
    order (:func:`kvwire.blocks.memory.group_memories`).
    """

    def __init__(
        self,
        inner: TransferHandler,
        memories: Sequence[BlockMemory],
        faults: LoadFaults,
    ) -> None:
        self.inner = inner
        self._memories = tuple(memories)
        self._faults = faults
        # Synchronous loads of this step to fail once the wrapped loads ended.
        self._sync_failures: list[tuple[int, int]] = []
        # Asynchronous loads to fail when reported finished, by request.
        self._async_failures: dict[str, tuple[int, int]] = {}
        self._failed: set[int] = set()

    def start_loads(
        self, loads: Sequence[BlockTransfer], async_loads: Sequence[BlockTransfer]
    ) -> None:
        self.inner.start_loads(loads, async_loads)
        for request_id, blocks in _loaded_ranges(loads).items():
            chosen = self._faults.choose(request_id, blocks)
            if chosen is not None:
                self._sync_failures.append(chosen)
        for request_id, blocks in _loaded_ranges(async_loads).items():
            chosen = self._faults.choose(request_id, blocks)
            if chosen is not None:
                self._async_failures[request_id] = chosen

    def wait_for_loads(self) -> None:
        self.inner.wait_for_loads()
        # Only now: the wrapped load, still running before, would overwrite the garbage.
        failures, self._sync_failures = self._sync_failures, []
        for group, block_id in failures:
            self._fail(group, block_id)

    def load_errors_so_far(self) -> set[int]:
        return self.inner.load_errors_so_far() | self._failed

    def take_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return self.inner.take_load_errors() | failed

    def take_finished_loads(self) -> set[str]:
        finished = self.inner.take_finished_loads()
        for request_id in finished:
            failure = self._async_failures.pop(request_id, None)
            if failure is not None:
                self._fail(*failure)
        return finished

    def save(self, saves: Sequence[BlockTransfer]) -> None:
        self.inner.save(saves)

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        return self.inner.release_saves_reading(request_ids, block_ids)

    def is_busy(self, request_id: str) -> bool:
        return self.inner.is_busy(request_id)

    def wait_for_saves(self, timeout_s: float | None = None) -> bool:
        return self.inner.wait_for_saves(timeout_s)

    def take_events(self) -> list[KVCacheEvent]:
        return self.inner.take_events()

    def take_counters(self) -> Mapping[str, float]:
        return self.inner.take_counters()

    def close(self) -> None:
        self.inner.close()

    def _fail(self, group: int, block_id: int) -> None:
        poison_block(self._memories[group], block_id)
        self._failed.add(block_id)


def _loaded_ranges(transfers: Sequence[BlockTransfer]) -> dict[str, list[tuple[int, int]]]:
    """Each request's loaded blocks as ``(group, block id)``, group after group, in block order."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for transfer in sorted(transfers, key=lambda transfer: transfer.group):
        ranges.setdefault(transfer.request_id, []).extend(
            (transfer.group, block_id) for block_id in transfer.block_ids
        )
    return ranges


class FaultInjectingMedium(Medium):
    """The medium :attr:`inner`, whose chosen loads fail; configured by subclassing.

    See the module docstring. A subclass must set :attr:`inner`; the class
    itself, without one, cannot be built.
    """

    inner: ClassVar[type[Medium]]
    """The medium whose blocks this one keeps (its keys, events, layouts and index)."""
    fail_request_ids: ClassVar[frozenset[str] | None] = None
    """The requests whose first load fails; None: every request's."""
    fail_block_index: ClassVar[int] = -1
    """Which block of the loaded range fails (negative: from the end)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inner = getattr(cls, "inner", None)
        if inner is not None:
            if not (isinstance(inner, type) and issubclass(inner, Medium)):
                raise TypeError(
                    f"{cls.__name__}.inner: expected a class deriving from "
                    f"kvwire.media.base.Medium, got {shown(inner)}"
                )
            if "event_medium" not in vars(cls):
                # KV cache events name the wrapped medium's place, unless told otherwise.
                cls.event_medium = inner.event_medium
        request_ids = cls.fail_request_ids
        if request_ids is not None and not (
            isinstance(request_ids, frozenset) and all(isinstance(r, str) for r in request_ids)
        ):
            raise TypeError(
                f"{cls.__name__}.fail_request_ids: expected a frozenset of request ids (str) "
                f"or None for every request, got {shown(request_ids)}"
            )
        if not isinstance(cls.fail_block_index, int) or isinstance(cls.fail_block_index, bool):
            raise TypeError(
                f"{cls.__name__}.fail_block_index: expected an int (negative counts from "
                f"the end), got {shown(cls.fail_block_index)}"
            )

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        self.inner_medium: Medium = self.inner_class()(context)
        """The wrapped medium, built from the same context."""

    @classmethod
    def inner_class(cls) -> type[Medium]:
        """:attr:`inner`, or a ``TypeError`` saying how to set it."""
        inner: type[Medium] | None = getattr(cls, "inner", None)
        if inner is None:
            raise TypeError(
                f"{cls.__name__}.inner is not set: subclass FaultInjectingMedium and set "
                "inner to the medium class to wrap (e.g. inner = DirectoryMedium)"
            )
        return inner

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return cls.inner_class().extra_config_keys()

    @classmethod
    def finish_options(cls, connector_name: str, options: dict[str, Any]) -> dict[str, Any]:
        return cls.inner_class().finish_options(connector_name, options)

    @property
    def layout(self) -> BlockLayout:
        # The wrapped medium's stored layout (a store medium's is sealed with its MAC).
        return self.inner_medium.layout

    @property
    def group_layouts(self) -> tuple[BlockLayout, ...]:
        return self.inner_medium.group_layouts

    def build_index(self) -> MediumIndex:
        return self.inner_medium.build_index()

    def build_handler(
        self, kv_caches: Mapping[str, torch.Tensor], counters: Counters
    ) -> FaultInjectingHandler:
        # Imported here: it needs torch, which the scheduler side never imports.
        from kvwire.blocks.memory import group_memories

        memories = group_memories(kv_caches, self.context.layout, self.context.groups)
        return FaultInjectingHandler(
            self.inner_medium.build_handler(kv_caches, counters),
            memories,
            LoadFaults(self.fail_request_ids, self.fail_block_index),
        )
