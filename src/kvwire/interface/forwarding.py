"""`ForwardingConnector`: a connector around another one, passing every call on to it.

A wrapper that changes a few calls of a connector (injects faults, records
them, translates what crosses) derives from it and overrides only those:
every other call of the interface reaches the wrapped connector unchanged,
including a call the interface gains later, since this class passes on each
call of `INTERFACE_CALLS`
(`forward_calls`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from kvwire.interface.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from kvwire.interface.calls import CallSide, calls_on, forward_calls
from kvwire.interface.types import Request

if TYPE_CHECKING:
    from kvwire.config import EngineConfig
    from kvwire.config.kv_cache import KVCacheConfig

__all__ = ["ForwardingConnector"]


def _wrapped_class(cls: type[ForwardingConnector], call: str) -> type[KVConnectorBase]:
    return cls.wrapped


def _inner_connector(connector: ForwardingConnector, call: str) -> KVConnectorBase:
    return connector.inner


@forward_calls(calls_on(CallSide.CLASS), to=_wrapped_class)
@forward_calls(calls_on(CallSide.SCHEDULER, CallSide.WORKER, CallSide.BOTH), to=_inner_connector)
class ForwardingConnector(KVConnectorBase, SupportsHMA):
    """A connector of one role around `inner`, a connector of the same role, built by the subclass.

    Each instance-level call goes to `inner` as it came; each class-level
    question (HMA support, extra-config validation, the KV cache layout,
    piecewise CUDA graphs, stats, metrics) to the class `wrapped`, so that
    the engine sees the wrapped connector's answers. The wrapper keeps the
    step's metadata and the KV cache manager it is given, as any connector
    does, and hands them on too.

    It serves HMA exactly when `wrapped` does (the HMA gate asks
    `supports_hma_for_config`); with HMA off, `request_finished_all_groups`
    reaches `inner` as `request_finished` with the one group's blocks.
    """

    wrapped: ClassVar[type[KVConnectorBase]]
    """The class of `inner`: the subclass sets it (a class made per wrapped class)."""

    def __init__(
        self,
        vllm_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        inner: KVConnectorBase,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.inner = inner
        """The wrapped connector, built for the same role."""

    def _inner_metadata(self, metadata: KVConnectorMetadata) -> KVConnectorMetadata:
        """The step metadata `inner` gets for `metadata`, built by this scheduler half.

        `metadata` itself; a wrapper whose `build_connector_meta` wraps
        `inner`'s metadata in its own returns `inner`'s here.
        """
        return metadata

    # The calls that do more than pass on what they are given.

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.inner.handle_preemptions(self._inner_metadata(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        inner_metadata = self._inner_metadata(connector_metadata)  # refuses a stranger's first
        super().bind_connector_metadata(connector_metadata)
        self.inner.bind_connector_metadata(inner_metadata)

    def clear_connector_metadata(self) -> None:
        self.inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # Not the base's: it would bind the block pool here, and `inner` binds it itself.
        self._kv_cache_manager = kv_cache_manager
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if supports_hma(self.inner):
            finished: tuple[bool, dict[str, Any] | None] = self.inner.request_finished_all_groups(  # type: ignore[attr-defined]
                request, block_ids
            )
            return finished
        # The HMA gate gives a connector without HMA one group.
        return self.inner.request_finished(request, block_ids[0])
