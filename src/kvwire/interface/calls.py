"""The connector interface's calls by the role that makes them, and one way to pass them on.

`kvwire.KVConnectorBase` declares each call once, with its
signature, its default and what it means. `INTERFACE_CALLS` says which
instance makes it: the scheduler-role one, the worker-role one, both, or
none (a question asked of the class). A connector that hands calls to
another object (a wrapped connector, the half of its role) does not write
them out again: `forward_calls` gives its class a method for each call it
names, which passes the arguments on unchanged and returns the answer, so a
call the interface gains reaches the other object without an edit of the
class. The type checker reads each passed-on call through the base's
declaration; a class keeps its own method wherever it does more than pass
a call on.
"""

from __future__ import annotations

import abc
import enum
import inspect
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from kvwire.interface.base import KVConnectorBase, SupportsHMA

__all__ = ["INTERFACE_CALLS", "CallSide", "calls_on", "forward_calls"]


class CallSide(enum.Enum):
    """Which connector instance a call of the interface is made on."""

    SCHEDULER = "scheduler"
    """The scheduler-role instance: lookups, allocations, the step's metadata, finished requests."""
    WORKER = "worker"
    """The worker-role instance: the paged cache, loads and saves, what they report."""
    BOTH = "both"
    """Either role's instance: the step's metadata bound and cleared, stats, shutdown."""
    CLASS = "class"
    """The class itself, before an instance exists (config checks, layout, stats' types)."""


_SCHEDULER, _WORKER, _BOTH, _CLASS = CallSide

INTERFACE_CALLS: Mapping[str, CallSide] = MappingProxyType(
    {
        # Asked of the class.
        "supports_hma_for_config": _CLASS,
        "validate_extra_config": _CLASS,
        "get_required_kvcache_layout": _CLASS,
        "requires_piecewise_for_cudagraph": _CLASS,
        "build_kv_connector_stats": _CLASS,
        "build_prom_metrics": _CLASS,
        # Either role.
        "bind_connector_metadata": _BOTH,
        "clear_connector_metadata": _BOTH,
        "get_kv_connector_stats": _BOTH,
        "shutdown": _BOTH,
        # The worker half.
        "prefer_cross_layer_blocks": _WORKER,
        "register_kv_caches": _WORKER,
        "register_cross_layers_kv_cache": _WORKER,
        "get_mem_pool_context": _WORKER,
        "set_host_xfer_buffer_ops": _WORKER,
        "handle_preemptions": _WORKER,
        "finish_forward": _WORKER,
        "reset_capture_state": _WORKER,
        "start_load_kv": _WORKER,
        "wait_for_layer_load": _WORKER,
        "save_kv_layer": _WORKER,
        "wait_for_save": _WORKER,
        "get_finished": _WORKER,
        "get_transfer_results": _WORKER,
        "get_block_ids_with_load_errors": _WORKER,
        "load_errors_this_step": _WORKER,
        "skip_saves_computed_from": _WORKER,
        "get_kv_connector_kv_cache_events": _WORKER,
        "wait_for_pending_saves": _WORKER,
        "get_handshake_metadata": _WORKER,
        "build_connector_worker_meta": _WORKER,
        # The scheduler half.
        "requires_kv_delivery": _SCHEDULER,
        "supports_divergent_local_hybrid_hits": _SCHEDULER,
        "bind_kv_cache_manager": _SCHEDULER,
        "bind_gpu_block_pool": _SCHEDULER,
        "on_new_request": _SCHEDULER,
        "get_loaded_kv_cache_group_ids": _SCHEDULER,
        "get_num_new_matched_tokens": _SCHEDULER,
        "update_state_after_alloc": _SCHEDULER,
        "build_connector_meta": _SCHEDULER,
        "get_external_cache_hit_sources": _SCHEDULER,
        "update_connector_output": _SCHEDULER,
        "request_finished": _SCHEDULER,
        "request_finished_all_groups": _SCHEDULER,
        "register_finished_partial_tail": _SCHEDULER,
        "take_events": _SCHEDULER,
        "has_pending_block_frees": _SCHEDULER,
        "has_pending_push_work": _SCHEDULER,
        "get_finished_count": _SCHEDULER,
        "reset_cache": _SCHEDULER,
        "set_xfer_handshake_metadata": _SCHEDULER,
        "set_xfer_handshake_metadata_pp_aware": _SCHEDULER,
    }
)
"""Every call of the interface by the side that makes it.

What a connector keeps of its own and never passes on (`role`, the configs it was built with,
`has_connector_metadata`) is not a call here. `request_finished_all_groups` is
`kvwire.SupportsHMA`'s.
"""


def calls_on(*sides: CallSide) -> tuple[str, ...]:
    """The interface's calls made on any of `sides`, in `INTERFACE_CALLS`' order."""
    return tuple(call for call, side in INTERFACE_CALLS.items() if side in sides)


_Target = TypeVar("_Target")
_Class = TypeVar("_Class", bound=type)


def forward_calls(
    calls: Iterable[str], to: Callable[[_Target, str], object]
) -> Callable[[_Class], _Class]:
    """A class decorator: each of `calls` the class does not define itself is passed on.

    The method it gets calls the method of the same name on `to(instance, call)`
    with the arguments it was given and returns its answer; a property reads
    the property of that name; a class-level call asks `to(cls, call)`. The
    method keeps the base's name, documentation and signature (`inspect`
    reads them). A name that is not a call of the interface is refused, so
    a misspelt one fails when the class is defined.
    """
    names = tuple(calls)
    unknown = [name for name in names if name not in INTERFACE_CALLS]
    if unknown:
        raise ValueError(f"not calls of the connector interface: {', '.join(unknown)}")

    def decorate(cls: _Class) -> _Class:
        for call in names:
            if call not in vars(cls):
                setattr(cls, call, _forwarder(cls, call, to))
        # The calls the class now defines are no longer abstract in it.
        abc.update_abstractmethods(cls)
        return cls

    return decorate


def _forwarder(owner: type, call: str, to: Callable[[Any, str], Any]) -> Any:
    """`owner`'s method (property, classmethod) passing `call` on to `to(self or cls, call)`."""
    declared = inspect.getattr_static(
        SupportsHMA if call == "request_finished_all_groups" else KVConnectorBase, call
    )
    if isinstance(declared, property):

        def read(self: object) -> Any:
            return getattr(to(self, call), call)

        return property(read, doc=declared.__doc__)
    function = declared.__func__ if isinstance(declared, classmethod) else declared

    def forward(self_or_cls: object, /, *args: Any, **kwargs: Any) -> Any:
        return getattr(to(self_or_cls, call), call)(*args, **kwargs)

    forward.__name__ = call
    forward.__qualname__ = f"{owner.__qualname__}.{call}"
    forward.__doc__ = function.__doc__
    forward.__wrapped__ = function  # type: ignore[attr-defined]  # inspect.signature reads it
    return classmethod(forward) if isinstance(declared, classmethod) else forward
