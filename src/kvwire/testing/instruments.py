"""Instruments the conformance kit attaches to a connector: a call log and strict roles.

Both work by shadowing the connector's interface methods on the instance, so
they see calls from the engine *and* calls a connector makes on itself: a
scheduler-role instance that calls its own `start_load_kv` is caught too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs

from kvwire.exceptions import RoleViolationError as RoleViolationError
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.interface.calls import CallSide, calls_on

WORKER_SIDE_METHODS: tuple[str, ...] = calls_on(CallSide.WORKER)
SCHEDULER_SIDE_METHODS: tuple[str, ...] = calls_on(CallSide.SCHEDULER)
_BOTH_SIDES: tuple[str, ...] = calls_on(CallSide.BOTH)


@attrs.frozen
class CallRecord:
    """One call into a connector: its role, the method, a detail and the result.

    `detail` is the request id for per-request calls, the layer name for
    per-layer calls, and the scheduled request ids for `build_connector_meta`.
    `block_ids` is a copy of the block ids the call hands over, one tuple
    per KV cache group: the request's for `update_state_after_alloc`,
    `request_finished` (one group) and `request_finished_all_groups`;
    for `build_connector_meta`, `(request id, per-group ids)` of each
    scheduled request; else empty.
    """

    role: KVConnectorRole
    method: str
    detail: Any
    result: Any
    block_ids: tuple[Any, ...] = ()


class CallLog:
    """Every recorded call, in order, across both roles of one engine."""

    def __init__(self) -> None:
        self.records: list[CallRecord] = []

    def of_role(self, role: KVConnectorRole) -> list[CallRecord]:
        return [record for record in self.records if record.role is role]

    def methods(self, role: KVConnectorRole) -> list[str]:
        return [record.method for record in self.of_role(role)]


def _detail(method: str, args: tuple[Any, ...]) -> Any:
    if not args:
        return None
    first = args[0]
    if method in ("wait_for_layer_load", "save_kv_layer"):
        return first
    if method == "build_connector_meta":
        return tuple(item.request_id for item in first.scheduled)
    if method == "get_finished":
        return frozenset(first)
    request_id = getattr(first, "request_id", None)
    return request_id


def _groups(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in block_ids)


def _block_ids(method: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    # A copy: the engine reuses and extends its lists after the call.
    if method == "update_state_after_alloc" and len(args) > 1:
        return _groups(args[1].get_block_ids())
    if method == "request_finished" and len(args) > 1:
        return (tuple(args[1]),)
    if method == "request_finished_all_groups" and len(args) > 1:
        return _groups(args[1])
    if method == "build_connector_meta" and args:
        return tuple((item.request_id, _groups(item.block_ids)) for item in args[0].scheduled)
    return ()


def _is_method(connector: KVConnectorBase, name: str) -> bool:
    # A call the interface answers with a property (`requires_kv_delivery`) is read, not called.
    if isinstance(getattr(type(connector), name, None), property):
        return False
    return callable(getattr(connector, name, None))


def record_calls(connector: KVConnectorBase, log: CallLog) -> None:
    """Append every interface call on `connector` (and its result) to `log`."""
    role = connector.role
    for name in (*WORKER_SIDE_METHODS, *SCHEDULER_SIDE_METHODS, *_BOTH_SIDES):
        if not _is_method(connector, name):
            continue
        original = getattr(connector, name)
        setattr(connector, name, _recording(original, name, role, log))


def _recording(
    original: Callable[..., Any], name: str, role: KVConnectorRole, log: CallLog
) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        record_index = len(log.records)
        log.records.append(
            CallRecord(role, name, _detail(name, args), None, _block_ids(name, args))
        )
        result = original(*args, **kwargs)
        log.records[record_index] = attrs.evolve(log.records[record_index], result=result)
        return result

    return call


def enforce_roles(connector: KVConnectorBase) -> None:
    """Make every call of the other role's side raise
    `kvwire.testing.RoleViolationError`."""
    role = connector.role
    forbidden = SCHEDULER_SIDE_METHODS if role is KVConnectorRole.WORKER else WORKER_SIDE_METHODS
    side = "scheduler" if role is KVConnectorRole.WORKER else "worker"
    class_name = type(connector).__name__
    for name in forbidden:
        if not _is_method(connector, name):
            continue

        def refuse(*args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise RoleViolationError(
                f"{class_name}.{_name} is a {side}-side call, but this instance has the "
                f"{role.name} role: a connector must not mix the two (strict-roles mode)"
            )

        setattr(connector, name, refuse)


@attrs.frozen
class Instruments:
    """The engine's connector hook for the kit: strict roles and/or a call log.

    Picklable when `log` is None, so it can go to a worker process.
    """

    strict_roles: bool = True
    log: CallLog | None = attrs.field(default=None, eq=False)

    def __call__(self, connector: KVConnectorBase) -> None:
        if self.strict_roles:
            enforce_roles(connector)
        if self.log is not None:
            record_calls(connector, self.log)
