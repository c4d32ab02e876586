"""A fault-injecting medium: another medium whose chosen loads fail, to exercise recovery.

Subclass `FaultInjectingMedium` and say, with class attributes, which
medium it wraps and which loads fail:

```python
class FailFirstDirectory(FaultInjectingMedium):
    inner = DirectoryMedium
    fail_request_ids = frozenset({"first"})
    fail_block_index = 0
```

For each request in `fail_request_ids` (every request when None), its
first load leaves garbage in one block of the loaded range, the one at
`fail_block_index` (the range is the request's blocks of every KV cache
group, group after group; an index past either end picks the block at that
end), and that block is reported as a load error, as a medium whose load
failed would: 0xFF bytes (NaN in every float dtype) in each layer of the
block's group. A synchronous load fails once the wrapped medium's loads of
the step ended, before the connector saves the step, so the connector's own
rule leaves out the saves computed from it; an asynchronous one fails when
it is reported finished.

Everything but the worker half's transfers is the wrapped medium's: its
`kv_connector_extra_config` keys, KV cache events, layouts and index. The
class is configured by attributes only, so a profile may name it
(`kv_connector_extra_config.medium: package.module:Class`) and a worker
process build it from that name; or a registry's medium provider may be
overridden with it (`kvwire.registry.media`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from kvwire.blocks.format import BlockLayout
from kvwire.common.redaction import shown
from kvwire.config.extra_config import ExtraConfigKey
from kvwire.interface.counters import Counters
from kvwire.media.base import Medium, MediumContext, MediumIndex
from kvwire.testing.faulty_medium.handler import FaultInjectingHandler, LoadFaults

if TYPE_CHECKING:
    import torch

__all__ = ["FaultInjectingMedium"]


class FaultInjectingMedium(Medium):
    """The medium `inner`, whose chosen loads fail; configured by subclassing.

    See the module docstring. A subclass must set `inner`; the class
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
        """`inner`, or a `TypeError` saying how to set it."""
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
        # Imported here: it needs torch, which the scheduler half never imports.
        from kvwire.blocks.memory import group_memories

        memories = group_memories(kv_caches, self.context.layout, self.context.groups)
        return FaultInjectingHandler(
            self.inner_medium.build_handler(kv_caches, counters),
            memories,
            LoadFaults(self.fail_request_ids, self.fail_block_index),
        )
