"""The `KVConnectorContainer`: the one place that knows how connectors are built.

Connectors never ask it for anything: it hands each one what its constructor
takes. Engines and applications use it:

```python
container = KVConnectorContainer()
container.config.from_dict(profile)               # or engine_config.override(...)
container.kv_cache_config.override(kv_cache_config)  # once memory is sized
scheduler_side = container.scheduler_connector()
...
container.shutdown_resources()                     # each built connector's shutdown()
```

Each role-scoped provider builds at most one connector per container and hands
it `(config, role, kv_cache_config)`, with an offload connector's `medium` built
(`medium_class`, `medium_options`, `medium_plugins`, `medium_context`, `medium`) or a
composite's `connector_builder`; a process that serves one role declares it
once (`kvwire.declare_role`) and asks `container.connector()`. Every part a
test may want to swap (`engine_config`, `kv_cache_config`, `registry`,
`connector_class`, the medium's steps, `hma_gate`, a connector) is a
provider, so dependency-injector's `override` does it and undoes it when its
`with` block ends.

The steps that follow from the connector's class are two sub-containers of
their own, their inputs `Dependency` providers, composed with
`providers.Container` and named by the container as its own: a
`kvwire.container.ConnectorSetupContainer` (the
HMA gate, the rank's layout, the medium's class) and a
`kvwire.container.MediumContainer` (the medium's options,
plug-ins, context and the medium). Each build gets a container of each shape
of its own, bound to what it resolved, so it enters the registry once for the
connector's class and once for its medium's; a composite's children are built
the same way, each by containers of its own
(`kvwire.container.ChildConnectorBuilder`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import attrs
from dependency_injector import containers, providers, resources

from kvwire.common.plugin_calls import call_plugin
from kvwire.common.redaction import shown
from kvwire.config import EngineConfig, KVTransferConfig, ParallelConfig
from kvwire.config.extra_config import ExtraConfigError, plugin_classes
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.config.profile import (
    load_profile,
    profile_origin,
    profile_path,
    read_profile_file,
    structure_engine_config,
)
from kvwire.exceptions import ConnectorBuildTimeout as ConnectorBuildTimeout
from kvwire.exceptions import ContainerSetupError, NotAConnectorError
from kvwire.hma import HMADecision, decide_hma, with_hma_decision
from kvwire.interface.base import ConnectorBuilder, KVConnectorBase, KVConnectorRole
from kvwire.registry import ConnectorRegistry, accepts_medium, default_registry

if TYPE_CHECKING:
    from kvwire.media.base import Medium, MediumContext

T = TypeVar("T")

_MEDIUM_FIELD = "kv_connector_extra_config.medium"


@runtime_checkable
class MediumBuildingConnector(Protocol):
    """What the container asks of a connector class that takes a medium, to build that medium.

    `kvwire.connectors.offload.OffloadConnector` answers through these
    classmethods; a connector class that declares a keyword-only `medium`
    needs all three (deriving from it gives them).
    """

    def medium_spec(self, kv_transfer_config: KVTransferConfig) -> str:
        """What names the medium: a registered name or `package.module:Class`."""
        ...

    def read_options(
        self, kv_transfer_config: KVTransferConfig, medium_cls: type[Medium]
    ) -> dict[str, Any]:
        """The extra config read over the connector's keys and `medium_cls`'s, finished."""
        ...

    def medium_context(
        self, config: EngineConfig, kv_cache_config: KVCacheConfig, options: dict[str, Any]
    ) -> MediumContext:
        """What the medium is built from: the cache layout, its groups, `options`."""
        ...


# MediumBuildingConnector's methods in the order a build calls them: the
# refusal of a class that lacks some names the first one its build needs.
_MEDIUM_BUILDING_METHODS = ("medium_spec", "read_options", "medium_context")


def _medium_building(connector_class: type[KVConnectorBase]) -> MediumBuildingConnector:
    """`connector_class`, which takes a medium, as what its medium is built through."""
    if isinstance(connector_class, MediumBuildingConnector):
        return connector_class
    missing = next(
        name
        for name in _MEDIUM_BUILDING_METHODS
        if not callable(getattr(connector_class, name, None))
    )
    raise ContainerSetupError(
        f"{connector_class.__name__} takes a keyword-only medium, but has no {missing} "
        "classmethod to build it with: derive it from "
        "kvwire.connectors.offload.OffloadConnector"
    )


def _engine_config_from(
    profile: Mapping[str, Any] | None, structured: dict[str, EngineConfig]
) -> EngineConfig:
    # One EngineConfig per distinct profile and container: both roles then
    # share one engine_id (a fresh uuid when the profile has none), and an
    # override of `config` is undone when its `with` block ends, which a
    # Singleton caching the first answer would not do.
    #
    # Threads that race here may each structure the profile, but setdefault
    # is atomic, so every one of them returns the EngineConfig stored first.
    key = json.dumps(profile or {}, sort_keys=True, default=repr)
    known = structured.get(key)
    if known is not None:
        return known
    return structured.setdefault(key, load_profile(profile or {}))


def _parallel_config_of(engine_config: EngineConfig) -> ParallelConfig:
    return engine_config.parallel_config


def _with_parallel_config(engine_config: EngineConfig, parallel: ParallelConfig) -> EngineConfig:
    if not isinstance(parallel, ParallelConfig):
        raise ContainerSetupError(
            f"parallel_config must provide a kvwire.config.ParallelConfig, got "
            f"{type(parallel).__name__}"
        )
    if parallel == engine_config.parallel_config:
        return engine_config
    return attrs.evolve(engine_config, parallel_config=parallel)


def _require_kv_transfer_config(engine_config: EngineConfig) -> KVTransferConfig:
    if engine_config.kv_transfer_config is None:
        raise ValueError("kv_transfer_config must be set to create a connector")
    return engine_config.kv_transfer_config


def _resolve_connector_class(
    registry: ConnectorRegistry, kv_transfer_config: KVTransferConfig
) -> type[KVConnectorBase]:
    return registry.resolve(kv_transfer_config)


def _a_connector_class(provided: object) -> type[KVConnectorBase]:
    """What `connector_class` provides, checked before anything builds with it.

    The registry checks the classes names lead to; an override is the one
    way around it, and a class that is no connector would otherwise fail
    deep inside the HMA gate or the constructor with an AttributeError.
    """
    if isinstance(provided, type) and issubclass(provided, KVConnectorBase):
        return provided
    raise NotAConnectorError(
        f"KVConnectorContainer.connector_class provides {shown(provided)}, not a connector "
        "class: override it with a subclass of kvwire.KVConnectorBase "
        "(kvwire.testing.IdleConnector is a complete one that does nothing, to subclass)"
    )


def _apply_hma_gate(
    engine_config: EngineConfig,
    connector_class: type[KVConnectorBase],
    registry: ConnectorRegistry,
) -> HMADecision:
    kv_transfer_config = _require_kv_transfer_config(engine_config)

    def is_supported() -> bool:
        # Asked of the class the container resolved (an override included);
        # a composite's hook asks about each child through the registry.
        return registry.class_supports_hma(connector_class, kv_transfer_config)

    return decide_hma(engine_config.scheduler_config, connector_class.__name__, is_supported)


def _resolve_medium_class(
    registry: ConnectorRegistry,
    connector_class: type[KVConnectorBase],
    kv_transfer_config: KVTransferConfig,
) -> type[Medium] | None:
    """The medium a connector keeps blocks in; None for a connector that takes none."""
    if not accepts_medium(connector_class):
        return None
    spec = _medium_building(connector_class).medium_spec(kv_transfer_config)
    medium_cls: type[Medium] = registry.media.get_class(spec)
    return medium_cls


def _medium_class_to_build(
    medium_class: Callable[[], type[Medium] | None],
) -> type[Medium] | None:
    try:
        return medium_class()
    except ValueError as error:
        # Worded as validate_extra_config words it, for `kvwire check` and the engine alike.
        raise ExtraConfigError(f"{_MEDIUM_FIELD}: {error}") from None


def _read_medium_options(
    connector_class: type[KVConnectorBase],
    medium_class: Callable[[], type[Medium] | None],
    kv_transfer_config: KVTransferConfig,
) -> dict[str, Any] | None:
    """The connector's extra config read over its medium's keys and finished; or None."""
    if not accepts_medium(connector_class):
        return None
    medium_cls = _medium_class_to_build(medium_class)
    if medium_cls is None:
        raise ContainerSetupError(
            f"KVConnectorContainer.medium_class provides None for {connector_class.__name__}, "
            "which takes a medium: override it with a kvwire.media.Medium subclass"
        )
    return _medium_building(connector_class).read_options(kv_transfer_config, medium_cls)


def _medium_plugins(
    registry: ConnectorRegistry,
    medium_class: Callable[[], type[Medium] | None],
    options: dict[str, Any] | None,
) -> dict[str, type] | None:
    """The classes the medium's plug-in options name, resolved through `registry`; or None."""
    if options is None:
        return None
    medium_cls = _medium_class_to_build(medium_class)
    if medium_cls is None:
        return None
    return plugin_classes(medium_cls.extra_config_keys(), options, registry)


def _medium_context(
    connector_class: type[KVConnectorBase],
    engine_config: EngineConfig,
    kv_cache_config: providers.Dependency[KVCacheConfig],
    options: dict[str, Any] | None,
    plugins: dict[str, type] | None,
) -> MediumContext | None:
    """What the medium is built from (layout, groups, options, plug-ins); None without a medium."""
    if options is None:
        return None
    sized_cache = _required(kv_cache_config, "kv_cache_config", _KV_CACHE_CONFIG_HOW)
    context = _medium_building(connector_class).medium_context(engine_config, sized_cache, options)
    if plugins:
        context = attrs.evolve(context, plugins=plugins)
    return context


def _build_medium(
    medium_class: Callable[[], type[Medium] | None], context: MediumContext | None
) -> Medium | None:
    """`medium_class()(context)`: one medium, for one connector to own."""
    if context is None:
        return None
    medium_cls = _medium_class_to_build(medium_class)
    if medium_cls is None:
        return None
    medium: Medium = call_plugin(
        _MEDIUM_FIELD, f"{medium_cls.__name__}()", lambda: medium_cls(context)
    )
    return medium


_KV_CACHE_CONFIG_HOW = (
    "call container.kv_cache_config.override(kv_cache_config) once the engine has sized its "
    "KV cache"
)


def _required(dependency: providers.Dependency[Any], what: str, how: str) -> Any:
    # Asked here rather than injected: dependency-injector's own error only
    # says 'Dependency "..." is not defined', which does not tell what to do.
    # A sub-container's input is overridden by what feeds it, perhaps a
    # Dependency of the parent container: the last one in that chain decides.
    source: providers.Provider[Any] = dependency
    while isinstance(source, providers.Dependency) and source.last_overriding is not None:
        source = source.last_overriding
    if isinstance(source, providers.Dependency) and source.default is None:
        raise ContainerSetupError(f"{what} is not set: {how}")
    return dependency()


class ConnectorSetupContainer(containers.DeclarativeContainer):
    """What a connector of a resolved class is built with, but its medium: its engine config
    (the HMA gate's decision, this rank's parallel layout) and its medium's class.

    Its inputs are `Dependency` providers. `KVConnectorContainer` composes one
    (`connector_setup`), fed from its own providers, whose steps it names as its
    own (`container.hma_gate` is `container.connector_setup.hma_gate`); each
    connector built, and each child of a composite, gets one of its own,
    bound to what its build resolved.
    """

    registry = providers.Dependency(instance_of=ConnectorRegistry)
    connector_class = providers.Dependency(instance_of=type)
    engine_config = providers.Dependency(instance_of=EngineConfig)
    kv_transfer_config = providers.Dependency(instance_of=KVTransferConfig)

    hma_gate = providers.Callable(_apply_hma_gate, engine_config, connector_class, registry)
    parallel_config = providers.Callable(_parallel_config_of, engine_config)
    connector_engine_config = providers.Callable(
        _with_parallel_config,
        providers.Callable(with_hma_decision, engine_config, hma_gate),
        parallel_config,
    )
    medium_class = providers.Callable(
        _resolve_medium_class, registry, connector_class, kv_transfer_config
    )


class MediumContainer(containers.DeclarativeContainer):
    """An offload connector's medium, one step per provider, from inputs it declares.

    Its inputs are `Dependency` providers: the connector's class, its medium's
    class, its transfer config, its engine config (gated and ranked), the
    sized cache and the registry plug-ins are resolved through.
    `KVConnectorContainer` composes one (`media`), fed from its own providers,
    whose steps it names as its own (`container.medium_options` is
    `container.media.medium_options`); each connector built, and each child
    of a composite, gets one of its own, bound to what its build resolved.
    """

    registry = providers.Dependency(instance_of=ConnectorRegistry)
    connector_class = providers.Dependency(instance_of=type)
    # None for a connector that takes no medium (or an override saying so).
    medium_class: providers.Dependency[type[Medium] | None] = providers.Dependency()
    kv_transfer_config = providers.Dependency(instance_of=KVTransferConfig)
    engine_config = providers.Dependency(instance_of=EngineConfig)
    kv_cache_config = providers.Dependency(instance_of=KVCacheConfig)

    medium_options = providers.Callable(
        _read_medium_options, connector_class, medium_class.provider, kv_transfer_config
    )
    medium_plugins = providers.Callable(
        _medium_plugins, registry, medium_class.provider, medium_options
    )
    medium_context = providers.Callable(
        _medium_context,
        connector_class,
        engine_config,
        kv_cache_config.provider,
        medium_options,
        medium_plugins,
    )
    medium = providers.Factory(_build_medium, medium_class.provider, medium_context)


class _SubContainer(providers.Container[T]):
    """A `providers.Container` whose inputs stay fed once its overrides are reset.

    Its inputs are fed by overriding them with the parent's providers, so the
    `reset_override()` of the parent (which resets this provider's overrides,
    and those of every provider in it) would otherwise leave them undefined.
    """

    def reset_override(self) -> None:
        super().reset_override()
        self.apply_overridings()


def _bound(
    shape: type[containers.DeclarativeContainer],
    template: containers.Container | None,
    **values: Any,
) -> containers.Container:
    """A container of `shape` for one build: each provider named in `values` bound to its value.

    What the build resolved (the connector's class, its medium's) or decided
    (the engine config) is bound once, so each step that needs it reads it
    here rather than entering the registry again. An override active on a
    step of `template` (the parent's composed `shape`, its inputs fed by the
    parent) is this build's too.
    """
    build = shape(**{name: providers.Object(value) for name, value in values.items()})
    if template is not None:
        for name, provider in template.providers.items():
            overriding = provider.last_overriding
            if name in values or overriding is None or isinstance(provider, providers.Dependency):
                continue
            build.providers[name].override(overriding)
    return build


def _build_connector(
    setup: containers.Container,
    media_template: containers.Container | None,
    role: KVConnectorRole,
    kv_cache_config: Callable[[], KVCacheConfig],
    connector_builder: ConnectorBuilder,
) -> KVConnectorBase:
    """The `role` connector `setup` (a `ConnectorSetupContainer` of this build) describes.

    Each step runs once: the engine config (the HMA gate), the sized cache,
    then, for a connector that takes a medium, the medium's class, bound
    with the rest into a `MediumContainer` of this build that builds the
    medium.
    """
    registry: ConnectorRegistry = setup.registry()
    connector_class: type[KVConnectorBase] = setup.connector_class()
    engine_config: EngineConfig = setup.connector_engine_config()
    sized_cache = kv_cache_config()
    medium: Medium | None = None
    if accepts_medium(connector_class):
        media = _bound(
            MediumContainer,
            media_template,
            registry=registry,
            connector_class=connector_class,
            medium_class=_medium_class_to_build(setup.medium_class),
            kv_transfer_config=setup.kv_transfer_config(),
            engine_config=engine_config,
            kv_cache_config=sized_cache,
        )
        medium = media.medium()
    return registry.instantiate(
        connector_class,
        engine_config,
        role,
        sized_cache,
        medium=medium,
        connector_builder=connector_builder,
    )


@attrs.frozen
class ChildConnectorBuilder:
    """Builds the connector an engine config names, as its container builds its own.

    A composite connector's `connector_builder` (the container's
    `connector_builder` provider). Each child is built by a
    `ConnectorSetupContainer` and a `MediumContainer` of its own, the shapes
    the container composes, bound to the child's class (resolved through
    `registry`, once) and its engine config as the composite hands it, HMA
    decided and ranked already: the HMA gate is the composite's alone, and so
    are the overrides of the container's steps. A child that is a composite
    builds its own children with this builder.
    """

    registry: ConnectorRegistry

    def __call__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> KVConnectorBase:
        transfer = _require_kv_transfer_config(config)
        setup = _bound(
            ConnectorSetupContainer,
            None,
            registry=self.registry,
            connector_class=self.registry.resolve(transfer),
            engine_config=config,
            kv_transfer_config=transfer,
            # HMA decided and ranked by the composite: no gate of the child's own.
            connector_engine_config=config,
        )
        return _build_connector(setup, None, role, lambda: kv_cache_config, self)


class ThreadSafeResource(providers.Resource[T]):
    """A `providers.Resource` that builds its resource once, whichever threads ask at once.

    dependency-injector's `Resource` checks and sets its state without a
    lock: threads racing on a constructor that releases the GIL (a connect,
    an allocation) each build one, and all but the last are never shut down.
    Here the first caller builds while the others wait for it, at most
    `build_wait_s` (then `kvwire.exceptions.ConnectorBuildTimeout`); a
    failed build leaves nothing behind, so the next caller tries again. Overrides answer before the
    lock is taken, and `shutdown()` takes it too, so a resource is never shut down while it is being
    built.
    """

    build_wait_s: float = 600.0
    """How long a caller waits for another thread's build; far above any sane constructor."""

    def __init__(self, provides: Any = None, *args: Any, **kwargs: Any) -> None:
        # A fresh lock also for each copy: a DeclarativeContainer deep-copies
        # its providers per instance, through this constructor.
        self._build_lock = threading.RLock()
        super().__init__(provides, *args, **kwargs)

    def _provide(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        with self._locked():
            # _provide is the cpdef hook Provider.__call__ calls once no
            # override answered; the stubs do not list it.
            provided: T = super()._provide(args, kwargs)  # type: ignore[misc]
            return provided

    def shutdown(self) -> Any:
        with self._locked():
            return super().shutdown()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if not self._build_lock.acquire(timeout=self.build_wait_s):
            raise ConnectorBuildTimeout(
                f"Another thread has been building this connector for more than "
                f"{self.build_wait_s:g} s; its constructor is stuck (a connect or an "
                "allocation without a deadline?)"
            )
        try:
            yield
        finally:
            self._build_lock.release()


class _ConnectorLifetime(resources.Resource[KVConnectorBase]):
    """Builds one role's connector; `shutdown_resources()` calls its `shutdown()`.

    A class-based resource rather than a generator: a container that is
    garbage-collected must not shut down a connector its owner still uses.
    """

    def init(
        self,
        role: KVConnectorRole,
        registry: ConnectorRegistry,
        connector_class: type[KVConnectorBase],
        engine_config: EngineConfig,
        kv_transfer_config: KVTransferConfig,
        kv_cache_config: providers.Dependency[KVCacheConfig],
        connector_builder: ConnectorBuilder,
        connector_setup: containers.Container,
        media: containers.Container,
    ) -> KVConnectorBase:
        setup = _bound(
            ConnectorSetupContainer,
            connector_setup,
            registry=registry,
            connector_class=connector_class,
            engine_config=engine_config,
            kv_transfer_config=kv_transfer_config,
        )
        return _build_connector(
            setup,
            media,
            role,
            lambda: _required(kv_cache_config, "kv_cache_config", _KV_CACHE_CONFIG_HOW),
            connector_builder,
        )

    def shutdown(self, connector: KVConnectorBase | None) -> None:
        if connector is not None:
            connector.shutdown()


def _role_key(process_role: providers.Dependency[KVConnectorRole]) -> str:
    role: KVConnectorRole = _required(
        process_role,
        "This process's connector role",
        "declare it once with kvwire.container.declare_role(container, KVConnectorRole.WORKER) "
        "(or SCHEDULER)",
    )
    return role.name.lower()


class KVConnectorContainer(containers.DeclarativeContainer):
    """Builds an engine's KV connectors: one per role, from a profile or an `EngineConfig`.

    Providers, in the order a connector is built:

    - `config`: the profile as a mapping (`config.from_dict(profile)`);
    - `engine_config`: the validated `EngineConfig` (override it with a
      ready one: `engine_config.override(providers.Object(config))`);
    - `kv_cache_config`: a `Dependency`, known once the engine sized its memory;
    - `registry`: the lazy connector registry (the process-wide one), and
      through it the media offload connectors keep blocks in
      (`registry().media.provider("directory").override(...)` swaps one;
      give the container a `default_registry().copy()` first to keep the
      override to it);
    - `kv_transfer_config` and `connector_class`: what the config names
      (an override that is no subclass of `KVConnectorBase` is refused
      with `kvwire.exceptions.NotAConnectorError` when first used);
    - `connector_setup`, a `kvwire.container.ConnectorSetupContainer`
      fed from the providers above, whose steps are the container's own:
        - `hma_gate`: the `kvwire.HMADecision` (raises for HMA
          demanded from a connector that cannot serve it);
        - `parallel_config`: the `ParallelConfig` (this
          process's rank, the tensor and pipeline parallel sizes): the engine
          config's by default; an engine's worker process (or a test building
          rank 1's connector) overrides it with its own rank;
        - `connector_engine_config`: the engine config with the gate's decision
          and the parallel layout;
        - `medium_class`: the medium an offload connector keeps blocks in (None
          for another connector), resolved through the registry; override it to
          swap the medium of this container's connectors:
          `container.medium_class.override(providers.Object(MyDirectory))`;
    - `media`, a `kvwire.container.MediumContainer` fed from the
      providers above, whose steps are the container's own:
        - `medium_options`: the connector's extra config read over its keys and
          the medium's, finished by the medium (None without a medium);
        - `medium_plugins`: the classes the medium's plug-in options name (the
          CPU pool's `eviction` policy), resolved through `registry`, so a policy
          registered or overridden on this container's registry is the one used;
        - `medium_context`: the `MediumContext` the medium is built from (the
          options and their plug-in classes, the KV cache groups, the layout of
          one entry);
        - `medium`: the medium itself, a `Factory`: one per connector built;
    - `connector_builder`: what a composite builds its children with
      (`kvwire.container.ChildConnectorBuilder`);
    - `scheduler_connector` / `worker_connector`: one connector per role,
      shut down by `shutdown_resources()`. Each build binds a
      `ConnectorSetupContainer` and a `MediumContainer` of its own to the
      class it resolved, once, and to the overrides active on the container's;
    - `process_role` and `connector`: the connector of the role this
      process declared.

    Connectors are built when first asked for; do not call
    `init_resources()`, which would build both roles' connectors in one
    process.
    """

    config = providers.Configuration()
    _structured_profiles: providers.Singleton[dict[str, EngineConfig]] = (
        providers.ThreadSafeSingleton(dict)
    )
    engine_config = providers.Callable(_engine_config_from, config, _structured_profiles)
    kv_cache_config = providers.Dependency(instance_of=KVCacheConfig)
    registry = providers.Singleton(default_registry)

    kv_transfer_config = providers.Callable(_require_kv_transfer_config, engine_config)
    connector_class = providers.Callable(_resolve_connector_class, registry, kv_transfer_config)
    # What the providers below build with: connector_class, overrides included, checked.
    _checked_connector_class = providers.Callable(_a_connector_class, connector_class)

    connector_setup: providers.Container[ConnectorSetupContainer] = _SubContainer(
        ConnectorSetupContainer,
        registry=registry,
        connector_class=_checked_connector_class,
        engine_config=engine_config,
        kv_transfer_config=kv_transfer_config,
    )
    hma_gate = connector_setup.hma_gate
    parallel_config = connector_setup.parallel_config
    connector_engine_config = connector_setup.connector_engine_config
    medium_class = connector_setup.medium_class

    media: providers.Container[MediumContainer] = _SubContainer(
        MediumContainer,
        registry=registry,
        connector_class=_checked_connector_class,
        medium_class=medium_class,
        kv_transfer_config=kv_transfer_config,
        engine_config=connector_engine_config,
        kv_cache_config=kv_cache_config,
    )
    medium_options = media.medium_options
    medium_plugins = media.medium_plugins
    medium_context = media.medium_context
    medium = media.medium

    connector_builder = providers.Factory(ChildConnectorBuilder, registry)

    # What either role's connector is built from (`_ConnectorLifetime.init`, after the role).
    _connector_inputs = (
        registry,
        _checked_connector_class,
        engine_config,
        kv_transfer_config,
        kv_cache_config.provider,
        connector_builder,
        connector_setup,
        media,
    )
    scheduler_connector: ThreadSafeResource[KVConnectorBase] = ThreadSafeResource(
        _ConnectorLifetime, KVConnectorRole.SCHEDULER, *_connector_inputs
    )
    worker_connector: ThreadSafeResource[KVConnectorBase] = ThreadSafeResource(
        _ConnectorLifetime, KVConnectorRole.WORKER, *_connector_inputs
    )
    del _connector_inputs

    process_role = providers.Dependency(instance_of=KVConnectorRole)
    connector = providers.Selector(
        providers.Callable(_role_key, process_role.provider),
        scheduler=scheduler_connector,
        worker=worker_connector,
    )


def declare_role(container: containers.Container, role: KVConnectorRole) -> None:
    """Declare, once, which role this process serves; `container.connector()` follows it."""
    if not isinstance(role, KVConnectorRole):
        raise TypeError(f"role must be a KVConnectorRole (SCHEDULER or WORKER), got {role!r}")
    container.process_role.override(providers.Object(role))


def role_connector_provider(
    container: containers.Container, role: KVConnectorRole
) -> providers.Provider[KVConnectorBase]:
    """The role-scoped provider of `role`: `scheduler_connector` or `worker_connector`."""
    if role is KVConnectorRole.SCHEDULER:
        return container.scheduler_connector
    if role is KVConnectorRole.WORKER:
        return container.worker_connector
    raise TypeError(f"role must be a KVConnectorRole (SCHEDULER or WORKER), got {role!r}")


def container_for_profile(
    profile: str | os.PathLike[str] | Mapping[str, Any] | EngineConfig,
    *,
    role: KVConnectorRole | None = None,
    kv_cache_config: KVCacheConfig | None = None,
    registry: ConnectorRegistry | None = None,
) -> KVConnectorContainer:
    """A container for `profile` (a shipped profile's name such as `"cpu-offload"`, a YAML
    path, a mapping or a built `EngineConfig`).

    The profile is validated here, so a bad one fails before anything else.
    A path or a mapping becomes the container's `config`: an override of
    any of its options
    (`container.config.kv_transfer_config.kv_connector.override(...)`)
    takes effect; a built `EngineConfig` is `engine_config` as it is.
    `role` and `kv_cache_config` are declared when given. `registry`
    replaces the process-wide one (e.g. `default_registry().copy()`, whose
    overrides reach no other container).
    """
    container = KVConnectorContainer()
    # The profile goes into `config`, the one source `engine_config` is
    # built from, so that an override of any of its options takes effect as
    # it does for a container loaded with `config.from_dict`.
    if isinstance(profile, EngineConfig):
        # Built already, and handed on as it is (the engine compares it by
        # identity): change it with attrs.evolve, or override engine_config.
        container.engine_config.override(providers.Object(profile))
    elif isinstance(profile, str | os.PathLike):
        document = read_profile_file(profile_path(profile))
        # Checked here, naming the file, so that a bad profile fails before anything else.
        structure_engine_config(document, origin=profile_origin(profile))
        container.config.from_dict(document)
    else:
        structure_engine_config(profile)
        container.config.from_dict(dict(profile))
    if kv_cache_config is not None:
        container.kv_cache_config.override(providers.Object(kv_cache_config))
    if role is not None:
        declare_role(container, role)
    if registry is not None:
        container.registry.override(providers.Object(registry))
    return container
