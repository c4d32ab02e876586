"""The `EngineContainer`: the one place that knows how the reference engine is assembled.

Each part of an engine is a provider, built once per container, so a test or
an application swaps one with dependency-injector's `override`:

```python
container = EngineContainer(config=engine_config)
container.connectors.connector_class.override(providers.Object(MyConnector))
engine = build_engine(container)          # or LLMEngine(engine_config) for the defaults
```

(`build_engine` lives in `kvwire.engine.engine`, which imports this module.)

The connector side is a `kvwire.KVConnectorContainer` composed as
`connectors`, its `engine_config` fed from this container's `config`; giving an instance
(`EngineContainer(config=..., connectors=my_container)`) uses that one, overrides included.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict

import attrs
import torch
from dependency_injector import containers, providers, resources

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig, build_kv_cache_config, sliding_window_of
from kvwire.container import KVConnectorContainer
from kvwire.engine.block_hash import root_hash
from kvwire.engine.block_manager import BlockManager
from kvwire.engine.connector_source import ConnectorHook, ConnectorSource, ContainerHook
from kvwire.engine.model import torch_dtype
from kvwire.engine.parallel import RankShare, engine_parallel_config, rank_share
from kvwire.engine.ranked_workers import RankedWorkers
from kvwire.engine.scheduler import Scheduler
from kvwire.engine.step import StepResult, WorkerStep
from kvwire.engine.worker_container import WorkerContainer
from kvwire.engine.worker_process import WorkerProcess
from kvwire.hma import HMADecision
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.interface.types import KVConnectorOutput

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "EngineContainer",
    "EngineParts",
    "WorkerHandle",
    "WorkerMode",
    "build_engine_parts",
    "decide_engine_hma",
    "engine_container",
]

logger = logging.getLogger(__name__)

WorkerMode = Literal["inline", "process"]

WorkerKind = Literal["inline", "process", "ranks"]


class WorkerHandle(Protocol):
    """What the engine asks of its worker, wherever that runs.

    The inline `Worker`, a `WorkerProcess` and `RankedWorkers` all answer these.
    """

    def execute(self, step: WorkerStep) -> StepResult: ...

    def gather_kv(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> torch.Tensor: ...

    def wait_for_saves(self, timeout_s: float) -> tuple[bool, KVConnectorOutput | None]: ...


@attrs.frozen
class EngineParts:
    """An engine's parts, built (by `EngineContainer`): what `LLMEngine` steps and closes.

    `worker` is the inline `Worker`, a `WorkerProcess` or `RankedWorkers`;
    `shares` is empty without tensor or pipeline parallelism.
    """

    config: EngineConfig
    hma: HMADecision
    kv_cache_config: KVCacheConfig
    shares: tuple[RankShare, ...]
    connector_source: ConnectorSource
    scheduler: Scheduler
    worker: WorkerHandle
    capture_kv: bool
    idle_timeout_s: float


def decide_engine_hma(config: EngineConfig, container: KVConnectorContainer) -> HMADecision:
    """Whether the engine runs the hybrid KV cache manager, and why.

    With a connector, the container's `hma_gate` decides (and raises for
    `disable_hybrid_kv_cache_manager: false` with a connector that cannot
    serve HMA). Without one, HMA is on unless that setting is true. Either
    way it only changes the cache layout of a model with sliding-window layers.
    """
    transfer = config.kv_transfer_config
    if transfer is not None and transfer.kv_connector is not None:
        if not container.connector_class.overridden:
            # A bad module path is the profile's error, named by its field,
            # not an ImportError from deep in the gate.
            container.registry().check_module_path(transfer)
        decision: HMADecision = container.hma_gate()
    elif config.scheduler_config.disable_hybrid_kv_cache_manager is True:
        decision = HMADecision(
            enabled=False, reason="disable_hybrid_kv_cache_manager is true: HMA is off"
        )
    else:
        decision = HMADecision(enabled=True, reason="no connector: HMA is on")
    if not config.model_config.is_hybrid:
        reason = f"{decision.reason} (no sliding-window layers: one KV cache group)"
        return attrs.evolve(decision, reason=reason)
    return decision


def _checked_config(config: EngineConfig, worker_mode: WorkerMode | None) -> EngineConfig:
    """`config`, once the options and the layout are known to run; `ValueError` naming the field.

    Checked before anything is built (the HMA gate, a connector): a bad
    option fails first, on its own.
    """
    parallel = config.parallel_config
    if worker_mode not in (None, "inline", "process"):
        raise ValueError(f"worker_mode: {worker_mode!r} is not one of inline, process")
    if parallel.is_split and worker_mode == "inline":
        raise ValueError(
            "worker_mode: inline runs one worker, but parallel_config asks for "
            f"tensor_parallel_size {parallel.tensor_parallel_size} x "
            f"pipeline_parallel_size {parallel.pipeline_parallel_size} "
            "ranks; use worker_mode='process' (or leave it unset)"
        )
    torch_dtype(config.model_config.dtype)  # reject an unsupported dtype up front
    if parallel.is_split:
        engine_parallel_config(config)  # reject a layout the engine cannot run, by name
    return config


def _worker_kind(config: EngineConfig, worker_mode: WorkerMode | None) -> WorkerKind:
    """One worker in this process, one in its own, or one process per rank."""
    if config.parallel_config.is_split:
        return "ranks"
    return worker_mode or "inline"


def _sized_kv_cache(config: EngineConfig, hma: HMADecision) -> KVCacheConfig:
    # Laid out after the HMA decision: the layout depends on it.
    kv_cache_config = build_kv_cache_config(config, hma.enabled)
    if config.model_config.is_hybrid:
        logger.info(
            "HMA %s: %s; %d KV cache group(s)",
            "on" if hma.enabled else "off",
            hma.reason,
            len(kv_cache_config.kv_cache_groups),
        )
    return kv_cache_config


def _rank_shares(config: EngineConfig, kv_cache_config: KVCacheConfig) -> tuple[RankShare, ...]:
    if not config.parallel_config.is_split:
        return ()
    return tuple(
        rank_share(config, kv_cache_config, rank)
        for rank in range(config.parallel_config.world_size)
    )


class _EngineConnectors(resources.Resource[ConnectorSource]):
    """This process's connectors; shutting the resource down shuts them down.

    With ranks, the scheduler side sees what vLLM's does: rank 0's share,
    the sizes; the inline worker (no ranks) shares the source.
    """

    def init(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        shares: tuple[RankShare, ...],
        hook: ConnectorHook | None,
        connectors: KVConnectorContainer,
    ) -> ConnectorSource:
        if shares:
            config, kv_cache_config = shares[0].connector_config, shares[0].kv_cache_config
            connectors.engine_config.override(providers.Object(config))
        return ConnectorSource(config, kv_cache_config, hook, connectors)

    def shutdown(self, source: ConnectorSource | None) -> None:
        if source is not None:
            source.shutdown()


def _scheduler_connector(source: ConnectorSource) -> KVConnectorBase | None:
    return source.connector(KVConnectorRole.SCHEDULER)


def _block_manager(config: EngineConfig, kv_cache_config: KVCacheConfig) -> BlockManager:
    cache = config.cache_config
    return BlockManager(
        kv_cache_config.num_blocks,
        cache.block_size,
        cache.enable_prefix_caching,
        [sliding_window_of(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups],
    )


def _finished_count(scheduler_connector: KVConnectorBase | None) -> int | None:
    return None if scheduler_connector is None else scheduler_connector.get_finished_count()


class EngineContainer(containers.DeclarativeContainer):
    """Assembles an `LLMEngine`: one provider per part.

    Inputs (give them as keywords, `EngineContainer(config=..., capture_kv=True)`,
    or override them):

    - `config`: the `EngineConfig` (required);
    - `worker_mode`, `connector_hook`, `capture_kv`, `idle_timeout_s`,
      `torch_threads`, `worker_reply_timeout_s`, `worker_container_hook`:
      the engine's options, as `LLMEngine` documents them;
    - `connectors`: the `kvwire.KVConnectorContainer` the
      engine's connectors come from, its `engine_config` fed from `config`
      (`connectors.connector_class.override(...)` swaps the connector).

    Parts, in the order they are built: `checked_config` (the options
    checked), `hma` (the HMA decision), `kv_cache_config` (the paged KV
    cache's layout), `shares` (each rank's, at tensor or pipeline
    parallelism), `connector_source` (this process's connectors, a
    resource), `scheduler_connector`, `block_manager`, `scheduler`,
    `inline_worker` (a `WorkerContainer`: the worker's paged KV cache, model
    and `Worker`), `worker` (the inline one, a `WorkerProcess`, or
    `RankedWorkers`; a worker process assembles a `WorkerContainer` of its
    own), and `parts`, which holds them for the engine. `build_engine` makes
    the engine of `parts`, shutting down what was built when a part fails;
    `LLMEngine.close` shuts the parts down.
    """

    config = providers.Dependency(instance_of=EngineConfig)
    worker_mode: providers.Provider[WorkerMode | None] = providers.Object(None)
    connector_hook: providers.Provider[ConnectorHook | None] = providers.Object(None)
    capture_kv: providers.Provider[bool] = providers.Object(False)
    idle_timeout_s: providers.Provider[float] = providers.Object(60.0)
    torch_threads: providers.Provider[int | None] = providers.Object(1)
    worker_reply_timeout_s: providers.Provider[float] = providers.Object(600.0)
    worker_container_hook: providers.Provider[ContainerHook | None] = providers.Object(None)

    checked_config = providers.Singleton(_checked_config, config, worker_mode)
    worker_kind = providers.Callable(_worker_kind, checked_config, worker_mode)
    connectors = providers.Container(KVConnectorContainer, engine_config=checked_config)

    hma = providers.Singleton(decide_engine_hma, checked_config, connectors)
    kv_cache_config = providers.Singleton(_sized_kv_cache, checked_config, hma)
    shares = providers.Singleton(_rank_shares, checked_config, kv_cache_config)
    connector_source = providers.Resource(
        _EngineConnectors, checked_config, kv_cache_config, shares, connector_hook, connectors
    )
    scheduler_connector = providers.Singleton(_scheduler_connector, connector_source)
    block_manager = providers.Singleton(_block_manager, checked_config, kv_cache_config)
    scheduler = providers.Singleton(
        Scheduler,
        checked_config,
        scheduler_connector,
        providers.Callable(root_hash, checked_config.provided.model_config),
        block_manager,
    )
    # The inline worker shares this process's connector source with the scheduler side.
    inline_worker = providers.Container(
        WorkerContainer,
        config=checked_config,
        kv_cache_config=kv_cache_config,
        torch_threads=torch_threads,
        connector_source=connector_source,
    )
    worker: providers.Provider[Any] = providers.Selector(
        worker_kind,
        inline=inline_worker.worker,
        process=providers.Singleton(
            WorkerProcess,
            checked_config,
            kv_cache_config,
            connector_hook=connector_hook,
            torch_threads=torch_threads,
            reply_timeout_s=worker_reply_timeout_s,
            container_hook=worker_container_hook,
        ),
        ranks=providers.Singleton(
            RankedWorkers,
            checked_config,
            shares,
            connector_hook=connector_hook,
            container_hook=worker_container_hook,
            torch_threads=torch_threads,
            reply_timeout_s=worker_reply_timeout_s,
            finished_count=providers.Callable(_finished_count, scheduler_connector),
        ),
    )
    # The scheduler (and its connector) first, then the worker, as a server starts.
    parts = providers.Singleton(
        EngineParts,
        config=checked_config,
        hma=hma,
        kv_cache_config=kv_cache_config,
        shares=shares,
        connector_source=connector_source,
        scheduler=scheduler,
        worker=worker,
        capture_kv=capture_kv,
        idle_timeout_s=idle_timeout_s,
    )


class EngineOptions(TypedDict, total=False):
    """`LLMEngine`'s keyword options; one left out keeps its `EngineContainer` default."""

    worker_mode: WorkerMode | None
    connector_hook: ConnectorHook | None
    capture_kv: bool
    idle_timeout_s: float
    container: KVConnectorContainer | None
    torch_threads: int | None
    worker_reply_timeout_s: float
    worker_container_hook: ContainerHook | None


def engine_container(config: EngineConfig, **options: Unpack[EngineOptions]) -> EngineContainer:
    """An `EngineContainer` for `config` and `LLMEngine`'s options (`container`: its connectors)."""
    unknown = sorted(options.keys() - EngineOptions.__optional_keys__)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    inputs: dict[str, Any] = dict(options)
    container = inputs.pop("container", None)
    if container is not None:
        inputs["connectors"] = container
    return EngineContainer(config=config, **inputs)


def build_engine_parts(container: EngineContainer) -> EngineParts:
    """`container.parts()`; when a part fails, the parts built already are shut down first.

    (A connector built for the scheduler side must not outlive a worker
    that failed to start.)
    """
    try:
        parts: EngineParts = container.parts()
    except BaseException:
        container.shutdown_resources()
        raise
    return parts
