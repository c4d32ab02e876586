"""The KV connector interface: what every connector implements.

A connector is built twice per engine, once per :class:`KVConnectorRole`.
The SCHEDULER instance decides what to load and save (pure bookkeeping); the
WORKER instance moves bytes between the paged KV cache and the connector's
store. The two never share state: everything the worker needs crosses in the
:class:`KVConnectorMetadata` the scheduler side builds each step.
"""

from __future__ import annotations

import abc
import enum
import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvwire.connector.types import (
    ForwardContext,
    KVCacheBlocks,
    KVCacheEvent,
    KVConnectorOutput,
    KVConnectorStats,
    Request,
    SchedulerOutput,
)

if TYPE_CHECKING:
    import torch

    from kvwire.config import EngineConfig, KVTransferConfig
    from kvwire.kv_cache_config import KVCacheConfig


class KVConnectorRole(enum.Enum):
    """Which half of the engine a connector instance serves."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step.

    Connectors subclass it with their own fields. It must be picklable: the
    worker may live in another process.
    """


HMAResolver = Callable[["KVTransferConfig"], bool]
"""Answers "does the connector this config names support HMA?" through the registry."""

ConnectorResolver = Callable[["KVTransferConfig"], "type[KVConnectorBase]"]
"""The class a (child) transfer config names, resolved through the registry that builds it."""

ConnectorBuilder = Callable[["EngineConfig", "KVConnectorRole", "KVCacheConfig"], "KVConnectorBase"]
"""Builds the connector a (child) engine config names, through the same registry.

A composite connector declares a keyword-only ``connector_builder`` constructor
parameter; whoever builds it (the container, ``KVConnectorFactory``) passes one,
so the children honour provider overrides, module paths and entry points.
"""


class KVConnectorBase(abc.ABC):
    """The base every KV connector derives from.

    Subclasses implement the abstract scheduler-side and worker-side calls;
    the rest have defaults that do nothing. The constructor takes the engine
    config, the role and the sized ``kv_cache_config`` (keep the 3-argument
    signature and call ``super().__init__``).
    """

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        if config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        self._config = config
        self._role = role
        self._kv_cache_config = kv_cache_config
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def engine_config(self) -> EngineConfig:
        return self._config

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        transfer_config = self._config.kv_transfer_config
        assert transfer_config is not None  # checked in __init__
        return transfer_config

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return self._kv_cache_config

    @classmethod
    def supports_hma_for_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: HMAResolver
    ) -> bool:
        """Whether this class, configured by ``kv_transfer_config``, supports HMA.

        The default is the class's own marker (:func:`supports_hma`).
        Composite connectors override it and ask ``resolve_child`` about each
        child config, so the answer goes through the same registry.
        """
        return supports_hma(cls)

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: ConnectorResolver
    ) -> None:
        """Reject a ``kv_connector_extra_config`` this class would reject, without building it.

        ``kvwire check`` calls it, so that a typo in a profile fails there and
        not at engine start. It must not allocate, open files or connect:
        building a connector to check it would (CPU offload allocates its
        pool). Raise a ``ValueError`` subclass (kvwire's connectors raise
        ``ExtraConfigError``) whose message names each bad key as
        ``kv_connector_extra_config.<key>``, one per line, and says what is
        accepted. Validate with the code the constructor uses, so ``check``
        and the engine never disagree. A composite validates each child's
        config through the class ``resolve_child`` returns: the registry that
        will build the child.

        The default checks nothing, so connectors written before this hook
        keep working; ``kvwire check`` then says their extra config was not
        checked (:func:`validates_extra_config`).
        """

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once with every layer's KV cache tensor, before the first step."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Set this step's metadata; called before the forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata; called after the step's reports were collected."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError(
                f"{type(self).__name__}: no connector metadata is bound; "
                "the worker calls bind_connector_metadata() before the forward pass"
            )
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    @abc.abstractmethod
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start loading this step's blocks into the paged cache, before the forward pass."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV for this step is in the cache."""

    @abc.abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Start saving ``layer_name``'s KV; called after the layer's attention."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until the paged cache may be overwritten again; end of the forward pass."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous (sending, receiving) finished since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed; their content must not be trusted."""
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last call (then reset), or None.

        The engine calls it after each step and once more after
        :meth:`shutdown`, for the transfers that finished while shutdown
        waited for them: it must still answer then.
        """
        return None

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        """KV cache events the worker side saw since the last call, then cleared.

        Blocks its saves stored, entries it removed. The engine calls it
        after each step (and after :meth:`wait_for_pending_saves`) and hands
        them to the scheduler side in ``KVConnectorOutput.kv_cache_events``,
        whose :meth:`take_events` reports them. A connector whose scheduler
        side knows its events itself reports none here. They cross to the
        scheduler's process: they must be picklable.
        """
        return []

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        """Block until every save started so far is complete; False if ``timeout_s`` ran out.

        Saves may outlive the step, and the request, that started them (a
        background write). The engine waits on this between workloads
        (``kvwire run`` after each pass) and when it closes, before
        :meth:`shutdown`, then reads the stats and the KV cache events, so
        that they count every save of the workload. The default has nothing
        to wait for: it suits connectors whose saves end within
        :meth:`wait_for_save`.
        """
        return True

    def get_handshake_metadata(self) -> Any:
        """What peers need to reach this worker (disaggregated connectors)."""
        return None

    def shutdown(self) -> None:
        """Let the transfers in flight finish, then release threads, files and connections.

        Called once at teardown. Only :meth:`get_kv_connector_stats` follows
        it, and it reports what those last transfers did.
        """

    # --------------------------------------------------------- scheduler side

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed_tokens``, and whether the load is async.

        ``None`` means "still looking, ask again next step". No side effects:
        it may be called several times for one request.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``; load into them if ``num_external_tokens``."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata for the worker side; resets per-step state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' merged report for the last step."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished; True keeps its blocks until it is reported finished sending."""
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV cache events since the last call."""
        return ()

    def get_finished_count(self) -> int | None:
        """How many workers must report a request finished; None means all of them."""
        return None

    def reset_cache(self) -> bool | None:
        """Forget everything stored; True on success, None when unsupported."""
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Rebuild this connector's stats from their serialized ``data``."""
        return KVConnectorStats(data=dict(data or {}))


class SupportsHMA(abc.ABC):
    """Marks a connector that serves several KV cache groups (the hybrid KV cache manager).

    Derive from it beside :class:`KVConnectorBase`. The engine then calls
    ``request_finished_all_groups`` instead of ``request_finished``.
    """

    @abc.abstractmethod
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Like ``request_finished``, with the request's block ids for every group."""


def supports_hma(connector: type | object) -> bool:
    """Whether a connector class (issubclass) or instance (isinstance) is HMA-capable."""
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


def validates_extra_config(connector_cls: type[KVConnectorBase]) -> bool:
    """Whether ``connector_cls`` has a ``validate_extra_config`` of its own (or inherits one).

    False when the one it gets is :class:`KVConnectorBase`'s, which checks nothing.
    """
    own = inspect.getattr_static(connector_cls, "validate_extra_config")
    return own is not inspect.getattr_static(KVConnectorBase, "validate_extra_config")


def supports_kw(callable_: Callable[..., Any], kw_name: str) -> bool:
    """Whether ``callable_`` accepts a parameter named ``kw_name``.

    True when the signature names it (in any position but ``*args``), or,
    failing that, when its last parameter is ``**kwargs``.
    """
    parameters = inspect.signature(callable_).parameters
    if not parameters:
        return False
    named = parameters.get(kw_name)
    if named is not None and named.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_ONLY,
    ):
        return True
    return list(parameters.values())[-1].kind is inspect.Parameter.VAR_KEYWORD
