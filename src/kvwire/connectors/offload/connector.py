"""The offload connector: whole blocks of every layer, keyed by block hash, kept in any medium.

kvwire's CPU offload, shared storage and Redis connectors are this one
connector over three media (`kvwire.media`); a new place to keep
blocks is a new `kvwire.media.Medium`, named in a profile by
`kv_connector_extra_config.medium` (a registered name such as
`directory`, or `package.module:Class`), never a new connector.

Each instance builds only its role's half (`RoleSplitConnector`):

- the scheduler half (`scheduler`) looks up
  the request's `block_hashes` in the medium's index beyond what the engine
  has locally, plans loads and saves (per KV cache group on hybrid models:
  a sliding-window group moves only the blocks its window reaches), and
  ships them each step in an `OffloadMetadata`;
- the worker half (`worker`) drives the
  medium's transfer handler: loads verified in the cache before a block
  counts as loaded (a failed one is a load error, computed again), saves
  read straight from the cache's blocks in the background.

Loads happen only for `kv_consumer`/`kv_both` engines, saves only for
`kv_producer`/`kv_both` ones. Its own `kv_connector_extra_config`
keys are `medium`, `async_load` (loads reported through
`get_finished`), `async_lookup` (a store medium is looked up on a lookup
thread, the request asked again until the answer is in, and a miss after
`lookup_deadline_s`, default 0.1), `load_failures_to_pause` (default 5) and
`load_pause_s` (default 10): after that many loads in a row failed, the
medium's hits are withheld for that long, then one load probes it
(`_load_breaker`); the medium declares the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import cache_groups, layers_per_group
from kvwire.blocks.paged_cache import check_cache_layout
from kvwire.common.plugin_calls import call_plugin
from kvwire.common.redaction import shown
from kvwire.config.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    bool_key,
    int_key,
    plugin_classes,
    read_extra_config,
    seconds_key,
)
from kvwire.connectors.offload._load_breaker import (
    DEFAULT_FAILURES_TO_PAUSE,
    DEFAULT_PAUSE_S,
    LoadBreaker,
)
from kvwire.connectors.offload._planner import BlockPlanner
from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
from kvwire.connectors.offload.worker import OffloadWorkerHalf
from kvwire.exceptions import ContainerSetupError
from kvwire.interface.base import (
    ConnectorLookup,
    KVConnectorRole,
    SupportsHMA,
)
from kvwire.interface.calls import forward_calls
from kvwire.interface.roles import RoleSplitConnector
from kvwire.interface.types import (
    ForwardContext,
    KVCacheEvent,
    KVConnectorStats,
    Request,
)
from kvwire.media.base import Medium, MediumContext

if TYPE_CHECKING:
    import torch

    from kvwire.config import EngineConfig, KVTransferConfig
    from kvwire.config.kv_cache import KVCacheConfig

__all__ = ["OffloadConnector"]

MEDIUM_FIELD = "kv_connector_extra_config.medium"

DEFAULT_LOOKUP_DEADLINE_S = 0.1
"""How long an `async_lookup` request waits for its lookup before computing its blocks itself.

Tens of round trips to a server 1 ms away, a few to one 20 ms away (a
lookup asks once per KV cache group). A request then waits at most this
long for a server that hangs, not the 1 s of a store's `lookup_timeout_s`.
"""


@forward_calls(
    (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "take_events",
        "reset_cache",
        "register_kv_caches",
        "handle_preemptions",
        "load_errors_this_step",
        "skip_saves_computed_from",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
        "wait_for_pending_saves",
    ),
    to=RoleSplitConnector._half_for,
)
class OffloadConnector(RoleSplitConnector[OffloadSchedulerHalf, OffloadWorkerHalf], SupportsHMA):
    """Loads and saves full blocks of every layer, keyed by block hash, in a medium.

    It is handed its medium built (the keyword-only `medium`): a
    `kvwire.KVConnectorContainer` resolves the class
    `kv_connector_extra_config.medium` names (`default_medium` when none),
    reads the options through `read_options`, builds the
    `kvwire.media.MediumContext` through `medium_context`
    and the medium from it, one per connector; each step is a provider a
    test overrides (`docs/container.md`).

    The calls its halves take as the interface makes them go to the half as
    they come (`forward_calls`); the methods below adapt the others.
    """

    default_medium: ClassVar[str] = "cpu_pool"

    # False: a sliding-window group saves every block, as a connector unaware
    # of windows would (the figure `--only hybrid` measures against).
    window_aware_saves: ClassVar[bool] = True

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        medium: Medium | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        if not isinstance(medium, Medium):
            # vLLM's factory calls a connector with three arguments; this one
            # cannot choose its medium itself, so the message says who does.
            raise ContainerSetupError(
                f"{type(self).__name__} needs its medium built: build the connector through "
                "kvwire.KVConnectorContainer (or kvwire.container_for_profile(...)), whose "
                f"`medium` provider builds it, or pass medium=..., got {shown(medium)}"
            )
        self._medium = medium
        context = medium.context
        groups, layout, options = context.groups, context.layout, context.options
        if role is KVConnectorRole.SCHEDULER:
            planner = BlockPlanner(
                layout.block_size,
                groups,
                loads=self.kv_transfer_config.is_kv_consumer,
                window_aware=self.window_aware_saves,
                saves=self.kv_transfer_config.is_kv_producer,
            )
            self._set_scheduler_half(
                OffloadSchedulerHalf(
                    index=call_plugin(
                        MEDIUM_FIELD,
                        f"{type(medium).__name__}.build_index",
                        self._medium.build_index,
                    ),
                    planner=planner,
                    num_groups=len(groups),
                    async_load=options["async_load"],
                    medium=f"medium {shown(options['medium'])}",
                    load_breaker=LoadBreaker(
                        f"medium {shown(options['medium'])}",
                        failures_to_pause=options["load_failures_to_pause"],
                        pause_s=options["load_pause_s"],
                    ),
                    lookup_deadline_s=(
                        options["lookup_deadline_s"] if options["async_lookup"] else None
                    ),
                )
            )
        else:
            self._set_worker_half(
                OffloadWorkerHalf(
                    connector_name=type(self).__name__,
                    medium=self._medium,
                    reports_lookups=config.parallel_config.rank == 0,
                )
            )

    # ------------------------------------------------------------- options

    @classmethod
    def medium_spec(cls, kv_transfer_config: KVTransferConfig) -> str:
        """What names the medium: `kv_connector_extra_config.medium`, else `default_medium`."""
        spec: str = kv_transfer_config.kv_connector_extra_config.get("medium", cls.default_medium)
        return spec

    @classmethod
    def medium_context(
        cls, config: EngineConfig, kv_cache_config: KVCacheConfig, options: dict[str, Any]
    ) -> MediumContext:
        """What the medium is built from: `config`'s cache layout, its groups and `options`.

        A cache that does not match `config`'s layout is refused here, before
        any medium is built.
        """
        if config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        groups = cache_groups(kv_cache_config)
        layout = attrs.evolve(
            BlockLayout.from_engine_config(config), num_layers=layers_per_group(groups)
        )
        check_cache_layout(layout, kv_cache_config)
        return MediumContext(
            cls.__name__,
            options,
            groups,
            layout,
            engine_id=config.kv_transfer_config.engine_id,
            parallel=config.parallel_config,
        )

    @classmethod
    def read_options(
        cls, kv_transfer_config: KVTransferConfig, medium_cls: type[Medium]
    ) -> dict[str, Any]:
        """The checked extra config over `medium_cls`, defaults filled (or `ExtraConfigError`).

        The container and `validate_extra_config` both read through it, so
        `kvwire check` and the engine reject the same values.
        """
        extra = kv_transfer_config.kv_connector_extra_config
        name = medium_cls.__name__
        # A medium class not configured for use (a FaultInjectingMedium
        # without inner) raises here too.
        medium_keys = call_plugin(
            MEDIUM_FIELD,
            f"{name} cannot be used: {name}.extra_config_keys",
            medium_cls.extra_config_keys,
        )
        if not (
            isinstance(medium_keys, tuple | list)
            and all(isinstance(key, ExtraConfigKey) for key in medium_keys)
        ):
            raise ExtraConfigError(
                f"{MEDIUM_FIELD}: {name}.extra_config_keys returned {shown(medium_keys)}, not a "
                "tuple of ExtraConfigKey (the keys it reads from kv_connector_extra_config)"
            )
        keys: tuple[ExtraConfigKey, ...] = (
            bool_key("async_load", False),
            bool_key("async_lookup", False),
            seconds_key("lookup_deadline_s", DEFAULT_LOOKUP_DEADLINE_S, maximum=3600),
            int_key("load_failures_to_pause", DEFAULT_FAILURES_TO_PAUSE, minimum=1, maximum=10**6),
            seconds_key("load_pause_s", DEFAULT_PAUSE_S, maximum=24 * 3600),
            ExtraConfigKey(
                "medium",
                cls.default_medium,
                lambda value: value if isinstance(value, str) else None,
                "a medium's name or 'package.module:Class'",
            ),
            *medium_keys,
        )
        options = read_extra_config(cls.__name__, extra, keys)
        finished = call_plugin(
            MEDIUM_FIELD,
            f"{name}.finish_options",
            lambda: medium_cls.finish_options(cls.__name__, options),
        )
        if not isinstance(finished, dict):
            raise ExtraConfigError(
                f"{MEDIUM_FIELD}: {name}.finish_options returned {shown(finished)}, not the "
                "options dict (it must return the options it was given, completed)"
            )
        return finished

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, registry: ConnectorLookup
    ) -> None:
        """Reads the options as the container does, and drops them: nothing is built.

        The medium and the classes its plug-in options name (the CPU pool's
        `eviction` policy) are resolved through `registry`, the one that will
        build the connector, so a medium or policy registered or overridden
        there is the one checked.
        """
        try:
            medium_cls = registry.media.get_class(cls.medium_spec(kv_transfer_config))
        except ValueError as error:
            raise ExtraConfigError(f"{MEDIUM_FIELD}: {error}") from None
        options = cls.read_options(kv_transfer_config, medium_cls)
        medium_cls.check_plugins(plugin_classes(medium_cls.extra_config_keys(), options, registry))

    @property
    def medium(self) -> Medium:
        """The medium this connector keeps blocks in."""
        return self._medium

    @property
    def layout(self) -> BlockLayout:
        """The layout of one entry, whatever its group (the groups differ only in their name)."""
        return self._medium.layout

    @property
    def group_layouts(self) -> tuple[BlockLayout, ...]:
        """Each KV cache group's entry layout, as the medium names them."""
        return self._medium.group_layouts

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role.name}, medium={type(self._medium).__name__})"

    # -------------------------------------------------------- scheduler half

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_half("request_finished").request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Not through request_finished: the engine makes one finishing call per
        # request, and a wrapper recording calls must see one.
        return self._scheduler_half("request_finished_all_groups").request_finished(request), None

    # ----------------------------------------------------------- worker half

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        half = self._worker_half("start_load_kv")
        half.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_half("wait_for_layer_load").wait_for_layer_load()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Blocks are read in wait_for_save, all layers at once, so each block
        # is read once, into one contiguous entry.
        self._worker_half("save_kv_layer")

    def wait_for_save(self) -> None:
        half = self._worker_half("wait_for_save")
        half.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_half("get_finished").get_finished()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Asked of both roles (vLLM's scheduler merges its connector's stats):
        # the scheduler half's counts travel in the metadata, so it has none.
        if self.role is KVConnectorRole.SCHEDULER:
            return None
        return self._worker_half("get_kv_connector_stats").get_kv_connector_stats()

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        return self._worker_half("get_kv_connector_kv_cache_events").take_events()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
