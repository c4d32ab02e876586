"""Connectors split by role: each instance builds only the half its role serves.

The engine builds a connector twice, once per `kvwire.KVConnectorRole`, and
the interface (vLLM's) puts both roles' calls on one class. A connector that
derives from `RoleSplitConnector` keeps each role's state in an object
of its own, built only for that role: a scheduler-role instance has no
worker half at all, so a worker-side call on it cannot touch worker state by
mistake; it raises `kvwire.exceptions.ConnectorRoleError` naming the
call. The halves are plain classes (`scheduler.py` / `worker.py` in a
connector's package), typed apart, so the type checker keeps the scheduler
half's code from reaching into the worker's. The split itself is
`RoleHalves`, which vLLM's side of the adapter (`KVWireConnector`) uses too.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Generic, TypeVar

from kvwire.exceptions import ConnectorRoleError
from kvwire.interface.base import KVConnectorBase
from kvwire.interface.calls import INTERFACE_CALLS, CallSide

_SchedulerHalf = TypeVar("_SchedulerHalf")
_WorkerHalf = TypeVar("_WorkerHalf")


class RoleHalves(Generic[_SchedulerHalf, _WorkerHalf]):
    """A connector's state in one half per role, of which only its own role's is built.

    A mixin beside a connector base, kvwire's or vLLM's (their `KVConnectorRole`
    members share their names). The connector builds its half in its
    constructor with `_set_scheduler_half` or `_set_worker_half`, as its
    `role` says, and reaches it in each call through `_scheduler_half` /
    `_worker_half` (or `_half_for`, the half of the side that makes a call,
    the `to` of `forward_calls`), which
    name the call in a `kvwire.exceptions.ConnectorRoleError`
    when the role is the other one.
    """

    _scheduler: _SchedulerHalf | None = None
    _worker: _WorkerHalf | None = None

    if TYPE_CHECKING:

        @property
        def role(self) -> enum.Enum:
            """The role the connector was built for."""
            ...

    def _set_scheduler_half(self, half: _SchedulerHalf) -> None:
        self._require_role(CallSide.SCHEDULER, "its scheduler half")
        self._scheduler = half

    def _set_worker_half(self, half: _WorkerHalf) -> None:
        self._require_role(CallSide.WORKER, "its worker half")
        self._worker = half

    def _scheduler_half(self, call: str) -> _SchedulerHalf:
        """The scheduler half, for `call`; a `ConnectorRoleError` on a worker-role connector."""
        if self._scheduler is None:
            raise self._wrong_role(call, CallSide.SCHEDULER)
        return self._scheduler

    def _worker_half(self, call: str) -> _WorkerHalf:
        """The worker half, for `call`; a `ConnectorRoleError` on a scheduler-role connector."""
        if self._worker is None:
            raise self._wrong_role(call, CallSide.WORKER)
        return self._worker

    def _half_for(self, call: str) -> _SchedulerHalf | _WorkerHalf:
        """The half of the role that makes `call` (`INTERFACE_CALLS`), for `call`."""
        side = INTERFACE_CALLS[call]
        if side is CallSide.SCHEDULER:
            return self._scheduler_half(call)
        if side is CallSide.WORKER:
            return self._worker_half(call)
        raise ValueError(f"{call} is made on {side.value}, not by one role's half")

    def _require_role(self, side: CallSide, what: str) -> None:
        if self.role.name != side.name:
            raise self._wrong_role(f"building {what}", side)

    def _wrong_role(self, call: str, needed: CallSide) -> ConnectorRoleError:
        return ConnectorRoleError(
            f"{type(self).__name__}: {call} is a {needed.value}-side call, but this "
            f"connector was built for the {self.role.name} role and holds no "
            f"{needed.value} state; build one with KVConnectorRole.{needed.name} "
            "for it (the engine builds one connector per role)"
        )


class RoleSplitConnector(KVConnectorBase, RoleHalves[_SchedulerHalf, _WorkerHalf]):
    """A kvwire connector whose state lives in one half per role; only its own role's is built.

    A subclass builds its half in its constructor, after `super().__init__`
    (`RoleHalves` says how), and passes
    the calls its halves take as they come on with
    `@forward_calls(..., to=RoleSplitConnector._half_for)`.
    """
