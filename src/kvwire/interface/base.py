"""The KV connector interface: what every connector implements.

A connector is built twice per engine, once per `kvwire.KVConnectorRole`.
The SCHEDULER instance decides what to load and save (pure bookkeeping); the
WORKER instance moves bytes between the paged KV cache and the connector's
store. The two never share state: everything the worker needs crosses in the
`kvwire.KVConnectorMetadata` the scheduler half builds each step.

The interface is vLLM's `KVConnectorBase_V1`: the constructor's keywords,
the `_vllm_config` / `_kv_transfer_config` / `_kv_cache_config`
attributes and every optional hook with vLLM's default, so a connector
written for vLLM runs here once its imports name kvwire
(`KVConnectorBase_V1` is an alias of `kvwire.KVConnectorBase`).

Each call is declared here once. `kvwire.interface.calls` says which role
makes it (a call added here is added there too; a test checks they agree),
and the connectors that pass calls on to another object (a wrapped
connector, a role's half) get their methods from that table.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from kvwire.interface.types import (
    CacheHitSource,
    ForwardContext,
    KVCacheBlocks,
    KVCacheEvent,
    KVConnectorOutput,
    KVConnectorStats,
    KVConnectorTransferResults,
    Request,
    SchedulerOutput,
)

if TYPE_CHECKING:
    import torch

    from kvwire.config import EngineConfig, KVTransferConfig
    from kvwire.config.kv_cache import KVCacheConfig


class KVConnectorRole(enum.Enum):
    """Which half of the engine a connector instance serves."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler half tells the worker half for one step.

    Connectors subclass it with their own fields. It must be picklable: the
    worker may live in another process.
    """


_Metadata = TypeVar("_Metadata", bound=KVConnectorMetadata)


def metadata_of_type(
    connector_name: str, metadata: KVConnectorMetadata, expected: type[_Metadata]
) -> _Metadata:
    """`metadata`, or a `TypeError` when another connector's scheduler half built it."""
    if not isinstance(metadata, expected):
        raise TypeError(
            f"{connector_name} got {type(metadata).__name__}, expected {expected.__name__}"
        )
    return metadata


class KVConnectorWorkerMetadata(abc.ABC):
    """What one worker tells the scheduler half for one step (the reverse of the metadata).

    The engine merges every worker's with `aggregate` and hands the
    result to `update_connector_output` in
    `KVConnectorOutput.kv_connector_worker_meta`. It must be picklable.
    """

    @abc.abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """This worker's metadata merged with `other`'s."""


class KVConnectorHandshakeMetadata:
    """What peers exchange out of band to reach a worker (disaggregated connectors); picklable."""


CopyBlocksOp = Callable[
    [
        dict[str, "torch.Tensor"],
        dict[str, "torch.Tensor"],
        list[int],
        list[int],
        Literal["h2d", "d2h"],
    ],
    None,
]
"""Copies blocks between device and host tensors: (sources, destinations, source
block ids, destination block ids, direction)."""

HMAResolver = Callable[["KVTransferConfig"], bool]
"""Answers "does the connector this config names support HMA?" through the registry."""

ConnectorResolver = Callable[["KVTransferConfig"], "type[KVConnectorBase]"]
"""The class a (child) transfer config names, resolved through the registry that builds it."""


class MediumLookup(Protocol):
    """The media of a registry: a medium class by name (or `package.module:Class`)."""

    def get_class(self, spec: str) -> type[Any]:
        """The medium class `spec` names; a `ValueError` when it names none."""
        ...


class ConnectorLookup(Protocol):
    """The registry that will build a connector, as `validate_extra_config` receives it.

    `kvwire.ConnectorRegistry` is one: `resolve` gives a (child) transfer
    config's class, `media` the medium classes an offload connector keeps blocks in.
    """

    @property
    def media(self) -> MediumLookup:
        """The media this registry's connectors keep blocks in."""
        ...

    def resolve(self, kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase]:
        """The connector class `kv_transfer_config` names."""
        ...


ConnectorBuilder = Callable[["EngineConfig", "KVConnectorRole", "KVCacheConfig"], "KVConnectorBase"]
"""Builds the connector a (child) engine config names, through the same registry.

A composite connector declares a keyword-only `connector_builder` constructor
parameter; the container that builds it passes its own (`connector_builder`,
which `KVConnectorFactory` builds through too), so each child's class and
medium are resolved through the container's registry: provider overrides,
module paths and entry points apply.
"""


class KVConnectorBase(abc.ABC):
    """The base every KV connector derives from.

    Subclasses implement the abstract scheduler-side and worker-side calls;
    the rest have vLLM's defaults (most do nothing). The constructor takes the
    engine config, the role and the sized `kv_cache_config`, positionally
    or as vLLM's keywords `vllm_config=`, `role=`, `kv_cache_config=`
    (keep the 3-argument signature and call `super().__init__`). It keeps
    them as vLLM's base does: `_vllm_config`, `_kv_transfer_config`,
    `_kv_cache_config`, `_role`; the properties below read them.
    """

    _cache_hit_source: CacheHitSource = CacheHitSource.EXTERNAL_UNSPECIFIED
    """Where this connector's hits come from (HOST, DISK, P2P), for hit-source metrics."""

    def __init__(
        self, vllm_config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        self._vllm_config = vllm_config
        self._kv_transfer_config: KVTransferConfig = vllm_config.kv_transfer_config
        self._role = role
        self._kv_cache_config = kv_cache_config
        self._kv_cache_manager: Any = None
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def engine_config(self) -> EngineConfig:
        return self._vllm_config

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        return self._kv_transfer_config

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return self._kv_cache_config

    @property
    def requires_kv_delivery(self) -> bool:
        """Whether KV handed off must reach its peer (a request preempted meanwhile is recomputed).

        Defaults to the producer roles: only a producer hands KV off when a
        request ends. A best-effort cache returns False: a dropped save is a
        later miss.
        """
        return self._kv_transfer_config.is_kv_producer

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """Whether this connector prefers one KV tensor holding every layer's blocks."""
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Whether its hits can complete a hybrid model's lagging groups; defaults to False."""
        return False

    @classmethod
    def supports_hma_for_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: HMAResolver
    ) -> bool:
        """Whether this class, configured by `kv_transfer_config`, supports HMA.

        The default is the class's own marker (`kvwire.supports_hma`).
        Composite connectors override it and ask `resolve_child` about each
        child config, so the answer goes through the same registry.
        """
        return supports_hma(cls)

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, registry: ConnectorLookup
    ) -> None:
        """Reject a `kv_connector_extra_config` this class would reject, without building it.

        `kvwire check` calls it, so that a typo in a profile fails there and
        not at engine start. It must not allocate, open files or connect:
        building a connector to check it would (CPU offload allocates its
        pool). Raise a `ValueError` subclass (kvwire's connectors raise
        `ExtraConfigError`) whose message names each bad key as
        `kv_connector_extra_config.<key>`, one per line, and says what is
        accepted. Validate with the code the constructor uses, so `check`
        and the engine never disagree. `registry` is the registry that will
        build the connector: a composite validates each child's config
        through the class `registry.resolve` returns, an offload connector
        resolves its medium through `registry.media`.

        The default checks nothing, so connectors written before this hook
        keep working; `kvwire check` then says their extra config was not
        checked (`validates_extra_config`).
        """

    # ------------------------------------------------------------ worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once with every layer's KV cache tensor, before the first step."""

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        """Called instead of `kvwire.KVConnectorBase.register_kv_caches` with
        one tensor for every layer.

        Only when `kvwire.KVConnectorBase.prefer_cross_layer_blocks` is
        true and the layers are uniform.
        """

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager[Any] | None:
        """A context to allocate the KV cache in (a custom memory pool), or None for the default."""
        return None

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        """The device-specific copy between device and host buffers, for host-staged transfers."""

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Deal with preempted requests before their blocks are overwritten (async savers)."""

    def finish_forward(self) -> None:
        """The model no longer reads this step's KV."""

    def reset_capture_state(self) -> None:
        """Undo worker state changed while CUDA graphs were captured."""

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
        """Block until `layer_name`'s KV for this step is in the cache."""

    @abc.abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Start saving `layer_name`'s KV; called after the layer's attention."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until the paged cache may be overwritten again; end of the forward pass."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous (sending, receiving) finished since the last call."""
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished sends and receives (and failed receives) in one snapshot.

        The default reads `kvwire.KVConnectorBase.get_finished` and knows of no
        failed receive.
        """
        sending, receiving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(receiving or ())
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed; their content must not be trusted."""
        return set()

    def load_errors_this_step(self) -> set[int]:
        """Block ids whose loads failed this step, known by the end of the forward pass.

        A composite asks each child before their
        `kvwire.KVConnectorBase.wait_for_save` and tells every child
        (`kvwire.KVConnectorBase.skip_saves_computed_from`), so that no
        child saves KV computed from a block whose load failed, whichever child loaded it. Unlike
        `kvwire.KVConnectorBase.get_block_ids_with_load_errors` it
        reports without clearing. The default knows of none.
        """
        return set()

    def skip_saves_computed_from(self, block_ids: set[int]) -> None:
        """In this step's `kvwire.KVConnectorBase.wait_for_save`, save nothing
        computed from these blocks.

        The default saves as planned: a connector that saves the blocks of a
        request whose load failed elsewhere must override it.
        """

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last call (then reset), or None.

        The engine calls it after each step and once more after
        `kvwire.KVConnectorBase.shutdown`, for the transfers that finished while
        shutdown waited for them: it must still answer then.
        """
        return None

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        """KV cache events the worker half saw since the last call, then cleared.

        Blocks its saves stored, entries it removed. The engine calls it
        after each step (and after
        `kvwire.KVConnectorBase.wait_for_pending_saves`) and hands them to
        the scheduler half in `KVConnectorOutput.kv_cache_events`, whose
        `kvwire.KVConnectorBase.take_events` reports them. A connector whose
        scheduler half knows its events itself reports none here. They cross to the scheduler's
        process: they must be picklable.
        """
        return []

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        """Block until every save started so far is complete; False if `timeout_s` ran out.

        Saves may outlive the step, and the request, that started them (a
        background write). The engine waits on this between workloads
        (`kvwire run` after each pass) and when it closes, before
        `kvwire.KVConnectorBase.shutdown`, then reads the stats and the KV cache events,
        so that they count every save of the workload. The default has nothing to wait for: it suits
        connectors whose saves end within `kvwire.KVConnectorBase.wait_for_save`.
        """
        return True

    def get_handshake_metadata(self) -> Any:
        """What peers need to reach this worker (disaggregated connectors)."""
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's report for the scheduler half (see `KVConnectorWorkerMetadata`)."""
        return None

    def shutdown(self) -> None:
        """Let the transfers in flight finish, then release threads, files and connections.

        Called once at teardown. Only
        `kvwire.KVConnectorBase.get_kv_connector_stats` follows it, and it
        reports what those last transfers did.
        """

    # --------------------------------------------------------- scheduler half

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """The scheduler's KV cache manager, once built; binds its block pool too."""
        self._kv_cache_manager = kv_cache_manager
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """The engine's block pool, for connectors that track blocks (ref counts, prefix cache)."""

    def on_new_request(self, request: Request) -> None:
        """The scheduler took in `request`; a place for per-request bookkeeping."""

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The KV cache groups a load for `request` restores: every group, by default."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond `num_computed_tokens`, and whether the load is async.

        `None` means "still looking, ask again next step". No side effects:
        it may be called several times for one request.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for `request`; load into them if `num_external_tokens`."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata for the worker half; resets per-step state."""

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """`num_external_tokens` split by the tier that holds them (non-zero counts only)."""
        if num_external_tokens == 0:
            return {}
        return {self._cache_hit_source: num_external_tokens}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' merged report for the last step."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request` finished; True keeps its blocks until it is reported finished sending."""
        return False, None

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Take charge of a finished request's partial last block; True keeps its blocks."""
        return False

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV cache events since the last call."""
        return ()

    def has_pending_block_frees(self) -> bool:
        """Whether transfers in flight will free blocks (so the scheduler need not preempt)."""
        return False

    def has_pending_push_work(self) -> bool:
        """Whether KV still waits to be pushed to a peer, so the engine must keep stepping."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: EngineConfig) -> str | None:
        """The KV cache layout this connector needs ("NHD", "HND"), or None for any."""
        if cls is KVConnectorBase:
            raise TypeError(
                "get_required_kvcache_layout should not be called on the abstract base class"
            )
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Whether its layer-by-layer calls need piecewise CUDA graphs with `extra_config`."""
        return False

    def get_finished_count(self) -> int | None:
        """How many workers must report a request finished; None means all of them."""
        return None

    def reset_cache(self) -> bool | None:
        """Forget everything stored; True on success, None when unsupported."""
        return None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild this connector's stats from their serialized `data`.

        kvwire's default keeps the counters as they are (vLLM's returns None);
        a connector with its own stats class returns one here.
        """
        return KVConnectorStats(data=dict(data or {}))

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Every worker's handshake metadata, by tensor-parallel rank."""

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Handshake metadata by (pipeline rank, tensor rank); only rank 0 unless overridden."""
        if any(pp_rank != 0 for pp_rank, _ in metadata):
            raise ValueError(
                f"{type(self).__name__} got handshake metadata for a pipeline rank > 0 but "
                "serves pipeline rank 0 only; a connector for pipeline-parallel KV transfer "
                "overrides set_xfer_handshake_metadata_pp_aware"
            )
        self.set_xfer_handshake_metadata({tp_rank: meta for (_, tp_rank), meta in metadata.items()})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: EngineConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """Prometheus metrics for this connector's stats, or None."""
        return None


KVConnectorBase_V1 = KVConnectorBase
"""vLLM's name for the base class, so that vLLM connectors need only their imports changed."""


class SupportsHMA(abc.ABC):
    """Marks a connector that serves several KV cache groups (the hybrid KV cache manager).

    Derive from it beside `kvwire.KVConnectorBase`. The engine then calls
    `request_finished_all_groups` instead of `request_finished`.
    """

    @abc.abstractmethod
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Like `request_finished`, with the request's block ids for every group."""


def supports_hma(connector: type | object) -> bool:
    """Whether a connector class (issubclass) or instance (isinstance) is HMA-capable."""
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


def validates_extra_config(connector_cls: type[KVConnectorBase]) -> bool:
    """Whether `connector_cls` has a `validate_extra_config` of its own (or inherits one).

    False when the one it gets is `kvwire.KVConnectorBase`'s, which checks
    nothing.
    """
    own = inspect.getattr_static(connector_cls, "validate_extra_config")
    return own is not inspect.getattr_static(KVConnectorBase, "validate_extra_config")


def supports_kw(callable_: Callable[..., Any], kw_name: str) -> bool:
    """Whether `callable_` accepts a parameter named `kw_name`.

    True when the signature names it (in any position but `*args`), or,
    failing that, when its last parameter is `**kwargs`.
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
