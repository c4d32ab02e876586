"""Connectors split by role: each instance builds only the half its role serves.

The engine builds a connector twice, once per [`KVConnectorRole`][kvwire.KVConnectorRole], and
the interface (vLLM's) puts both roles' calls on one class. A connector that
derives from `RoleSplitConnector` keeps each role's state in an object
of its own, built only for that role: a scheduler-role instance has no
worker half at all, so a worker-side call on it cannot touch worker state by
mistake; it raises [`ConnectorRoleError`][kvwire.exceptions.ConnectorRoleError] naming the
call. The halves are plain classes (`scheduler.py` / `worker.py` in a
connector's package), typed apart, so the type checker keeps the scheduler
half's code from reaching into the worker's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

from kvwire.exceptions import ConnectorRoleError
from kvwire.interface.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from kvwire.config import EngineConfig
    from kvwire.config.kv_cache import KVCacheConfig

_SchedulerHalf = TypeVar("_SchedulerHalf")
_WorkerHalf = TypeVar("_WorkerHalf")


class RoleSplitConnector(KVConnectorBase, Generic[_SchedulerHalf, _WorkerHalf]):
    """A connector whose state lives in one half per role; only its own role's half is built.

    A subclass builds its half in its constructor, after `super().__init__`,
    with `_set_scheduler_half` or `_set_worker_half` as
    `role` says, and reaches it in each call through
    `_scheduler_half` / `_worker_half`, which name the call when
    the role is the other one.
    """

    def __init__(
        self, vllm_config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: _SchedulerHalf | None = None
        self._worker: _WorkerHalf | None = None

    def _set_scheduler_half(self, half: _SchedulerHalf) -> None:
        self._require_role(KVConnectorRole.SCHEDULER, "its scheduler half")
        self._scheduler = half

    def _set_worker_half(self, half: _WorkerHalf) -> None:
        self._require_role(KVConnectorRole.WORKER, "its worker half")
        self._worker = half

    def _scheduler_half(self, call: str) -> _SchedulerHalf:
        """The scheduler half, for `call`; a `ConnectorRoleError` on a worker-role connector."""
        if self._scheduler is None:
            raise self._wrong_role(call, KVConnectorRole.SCHEDULER)
        return self._scheduler

    def _worker_half(self, call: str) -> _WorkerHalf:
        """The worker half, for `call`; a `ConnectorRoleError` on a scheduler-role connector."""
        if self._worker is None:
            raise self._wrong_role(call, KVConnectorRole.WORKER)
        return self._worker

    def _require_role(self, role: KVConnectorRole, what: str) -> None:
        if self.role is not role:
            raise self._wrong_role(f"building {what}", role)

    def _wrong_role(self, call: str, needed: KVConnectorRole) -> ConnectorRoleError:
        return ConnectorRoleError(
            f"{type(self).__name__}: {call} is a {needed.name.lower()}-side call, but this "
            f"connector was built for the {self.role.name} role and holds no "
            f"{needed.name.lower()} state; build one with KVConnectorRole.{needed.name} "
            "for it (the engine builds one connector per role)"
        )
