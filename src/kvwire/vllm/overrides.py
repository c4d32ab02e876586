"""The kvwire profile's values that vLLM's configuration replaces, logged once per engine.

Inside vLLM, the model's shape, the KV dtype, the block size, the parallel
layout, the scheduler's limits, `kv_role`, `engine_id` and
`kv_load_failure_policy` are vLLM's (`kvwire.vllm.config_bridge.engine_config_from_vllm`).
A profile that sets one of them to something else says what its author
expected, so each such field is logged at WARNING, naming the field, both
values and that vLLM's applies. A field left at kvwire's default was not set
by the profile (the shipped profiles leave most at it) and is replaced
quietly. The scheduler half logs: vLLM builds one per engine, and a worker
per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs

from kvwire.common.redaction import shown
from kvwire.config import EngineConfig
from kvwire.vllm.config_bridge import read_kvwire_profile

__all__ = ["OverriddenValue", "log_overridden_values", "overridden_values"]

logger = logging.getLogger(__name__)

# The profile's model identity names the weights and applies (vLLM's computation is
# added to it); kvwire's own engine's layer layout is read from vLLM's KV cache groups.
_NOT_REPLACED = frozenset({"model_config.identity"})
_FROM_VLLM_S_MODEL = frozenset({"model_config.layer_types", "model_config.sliding_window"})
_SECTIONS = ("model_config", "cache_config", "parallel_config", "scheduler_config")


@attrs.frozen
class OverriddenValue:
    """A field the profile set that vLLM's configuration replaces (read-only)."""

    field: str
    profile_value: object
    vllm_value: str


def overridden_values(
    profile: EngineConfig, applied: EngineConfig, *, profile_sets_engine_id: bool
) -> list[OverriddenValue]:
    """Each field `profile` sets to something other than what `applied` (vLLM's) runs with.

    `profile_sets_engine_id`: whether the profile named an `engine_id`
    (one it leaves out is a fresh id, never its default, so only its reader
    can tell).
    """
    found = []
    for section in _SECTIONS:
        ours, theirs = getattr(profile, section), getattr(applied, section)
        defaults = type(ours)()
        for field in attrs.fields(type(ours)):
            name = f"{section}.{field.name}"
            value = getattr(ours, field.name)
            if name in _NOT_REPLACED or value == getattr(defaults, field.name):
                continue
            if name in _FROM_VLLM_S_MODEL:
                found.append(OverriddenValue(name, value, "the model vLLM loads"))
            elif value != getattr(theirs, field.name):
                found.append(OverriddenValue(name, value, shown(getattr(theirs, field.name))))
    wrapped, applied_transfer = profile.kv_transfer_config, applied.kv_transfer_config
    if wrapped is None or applied_transfer is None:
        return found
    transfer_fields = attrs.fields_dict(type(wrapped))
    for name in ("kv_role", "kv_load_failure_policy"):
        value = getattr(wrapped, name)
        if value != transfer_fields[name].default and value != getattr(applied_transfer, name):
            found.append(
                OverriddenValue(
                    f"kv_transfer_config.{name}", value, shown(getattr(applied_transfer, name))
                )
            )
    if profile_sets_engine_id and wrapped.engine_id != applied_transfer.engine_id:
        found.append(
            OverriddenValue(
                "kv_transfer_config.engine_id", wrapped.engine_id, shown(applied_transfer.engine_id)
            )
        )
    return found


def log_overridden_values(
    profile: EngineConfig, applied: EngineConfig, extra_config: Mapping[str, Any]
) -> None:
    """Log each of `overridden_values` at WARNING, one record per field.

    `profile` was read from `extra_config` (vLLM's
    `kv_connector_extra_config`), which is read once more to tell whether
    it names an `engine_id`: one it leaves out is a fresh id at each read.
    """
    reread = read_kvwire_profile(extra_config).kv_transfer_config
    sets_engine_id = (
        reread is not None
        and profile.kv_transfer_config is not None
        and reread.engine_id == profile.kv_transfer_config.engine_id
    )
    for overridden in overridden_values(profile, applied, profile_sets_engine_id=sets_engine_id):
        logger.warning(
            "%s: the kvwire profile says %s, vLLM's configuration says %s; vLLM's applies",
            overridden.field,
            shown(overridden.profile_value),
            overridden.vllm_value,
        )
