"""A MultiConnector's children as configured: their transfer configs and their errors' wording.

Children come from `kv_connector_extra_config["connectors"]`, a list of
`KVTransferConfig` keyword mappings (`engine_id` and `kv_role` default
to the parent's). A problem is named by the child's path
(`kv_connector_extra_config.connectors[1].kv_connector_extra_config.<key>`),
so the constructor and `kvwire check` report the same words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvwire.common.redaction import kind_of, shown_key
from kvwire.config import KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError

if TYPE_CHECKING:
    from kvwire.config import EngineConfig
    from kvwire.interface.base import ConnectorLookup, ConnectorResolver, HMAResolver


def child_transfer_configs(parent: KVTransferConfig) -> list[KVTransferConfig]:
    """The children's transfer configs; errors name `kv_connector_extra_config.connectors[i]`."""
    extra = parent.kv_connector_extra_config
    # Sorted and named as read_extra_config does: keys may be of mixed types, long or unprintable.
    unknown = sorted((key for key in extra if key != "connectors"), key=shown_key)
    if unknown:
        raise ExtraConfigError(
            f"kv_connector_extra_config.{shown_key(unknown[0])} is not an option of "
            "MultiConnector; accepted keys are: connectors"
        )
    children = extra.get("connectors")
    # Values are named by their type, never echoed: a secret typed in the
    # wrong place (a URL with its password) would be printed.
    if not isinstance(children, list) or not children:
        given = "an empty list" if isinstance(children, list) else kind_of(children)
        raise ExtraConfigError(
            f"kv_connector_extra_config.connectors: {given} is not accepted by "
            "MultiConnector; expected a non-empty list of kv_transfer_config mappings"
        )
    configs = []
    for index, child in enumerate(children):
        where = _child_path(index)
        if not isinstance(child, Mapping):
            raise ExtraConfigError(
                f"{where}: expected a mapping of kv_transfer_config fields, got {kind_of(child)}"
            )
        if not isinstance(child.get("kv_connector"), str):
            raise ExtraConfigError(f"{where}.kv_connector: expected a connector name")
        fields = {"engine_id": parent.engine_id, "kv_role": parent.kv_role, **child}
        try:
            configs.append(KVTransferConfig(**fields))
        except (TypeError, ValueError) as error:
            raise ExtraConfigError(f"{where}: {error}") from error
    return configs


def child_names(configs: Sequence[KVTransferConfig]) -> list[str]:
    """Each child's name: its `kv_connector`, with `#<index>` after a repeated one."""
    names: list[str] = []
    for config in configs:
        name = str(config.kv_connector)
        names.append(name if name not in names else f"{name}#{len(names)}")
    return names


def children_prom_metrics(
    resolve_child: ConnectorResolver,
    vllm_config: EngineConfig,
    metric_types: dict[type, type],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> dict[str, Any]:
    """Each child's Prometheus metrics by child name; one build per child class, as vLLM's.

    A child whose class builds none (None) is left out.
    """
    assert vllm_config.kv_transfer_config is not None
    configs = child_transfer_configs(vllm_config.kv_transfer_config)
    built: dict[type, Any] = {}
    by_child: dict[str, Any] = {}
    for name, child_config in zip(child_names(configs), configs, strict=True):
        child_cls = resolve_child(child_config)
        if child_cls not in built:
            built[child_cls] = child_cls.build_prom_metrics(
                attrs.evolve(vllm_config, kv_transfer_config=child_config),
                metric_types,
                labelnames,
                per_engine_labelvalues,
            )
        if built[child_cls] is not None:
            by_child[name] = built[child_cls]
    return by_child


def child_config_error(index: int, error: ValueError) -> ExtraConfigError:
    """`error`, raised for child `index`'s config, with its keys named from the parent.

    A line that names a key as `kv_connector_extra_config.<key>` (every
    problem line of kvwire's connectors does) gets the child's path in front
    of it, so each problem still says which child it is about; a first line
    that names no key (a heading, or a third party's wording) gets
    `<path>: ` in front.
    """
    where = _child_path(index)
    first, *rest = str(error).split("\n")
    head = _within(where, first)
    if head == first:
        head = f"{where}: {first}"
    return ExtraConfigError("\n".join([head, *(_within(where, line) for line in rest)]))


def validate_children(parent: KVTransferConfig, registry: ConnectorLookup) -> None:
    """The parent's keys, then each child's through the child's class; stops at the first bad one.

    Each child's class comes from `registry`, the one that will build it.
    The constructor stops at the first bad child too, with the same words.
    """
    for index, child_config in enumerate(child_transfer_configs(parent)):
        try:
            registry.resolve(child_config).validate_extra_config(child_config, registry)
        except ValueError as error:
            raise child_config_error(index, error) from error


def children_support_hma(parent: KVTransferConfig, resolve_child: HMAResolver) -> bool:
    """Whether every configured child supports HMA; False without (valid) children."""
    children = parent.kv_connector_extra_config.get("connectors")
    if not isinstance(children, list) or not children:
        return False
    return all(resolve_child(config) for config in child_transfer_configs(parent))


def children_kv_cache_layout(
    resolve_child: ConnectorResolver, vllm_config: EngineConfig
) -> str | None:
    """The KV cache layout the children need, or None; different needs are an error."""
    assert vllm_config.kv_transfer_config is not None
    layouts = set()
    for child_config in child_transfer_configs(vllm_config.kv_transfer_config):
        child_cls = resolve_child(child_config)
        layout = child_cls.get_required_kvcache_layout(
            attrs.evolve(vllm_config, kv_transfer_config=child_config)
        )
        if layout is not None:
            layouts.add(layout)
    if len(layouts) > 1:
        raise ValueError(
            f"MultiConnector: children need different KV cache layouts "
            f"({', '.join(sorted(layouts))}); every child must accept the same one"
        )
    return next(iter(layouts), None)


def any_child_requires_piecewise(
    resolve_child: ConnectorResolver, connector_name: str, extra_config: dict[str, Any]
) -> bool:
    """Whether a child needs piecewise CUDA graphs, given the parent's extra config."""
    parent = KVTransferConfig(
        kv_connector=connector_name, kv_role="kv_both", kv_connector_extra_config=extra_config
    )
    return any(
        resolve_child(child).requires_piecewise_for_cudagraph(child.kv_connector_extra_config)
        for child in child_transfer_configs(parent)
    )


def _child_path(index: int) -> str:
    return f"kv_connector_extra_config.connectors[{index}]"


def _within(where: str, line: str) -> str:
    text = line.lstrip()
    if not text.startswith("kv_connector_extra_config."):
        return line
    return f"{line[: len(line) - len(text)]}{where}.{text}"
