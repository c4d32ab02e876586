"""Drives connectors directly, both roles, over real paged-cache tensors.

The scheduler side and the worker side are separate instances, and the
metadata crosses between them pickled, as it would between processes. The
caches have the engine's own layout (``cache_config_for`` is the engine's).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from dependency_injector import providers

from kvwire.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.container import (
    KVConnectorContainer,
    container_for_profile,
    role_connector_provider,
)
from kvwire.engine.engine import build_kv_cache_config as cache_config_for
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.interface.types import (
    ForwardContext,
    KVCacheBlocks,
    KVConnectorOutput,
    Request,
    ScheduledRequest,
    SchedulerOutput,
)
from kvwire.media.base import Medium
from kvwire.registry import ConnectorRegistry

C = TypeVar("C", bound=KVConnectorBase)


def build_connector(
    connector_class: type[C],
    config: EngineConfig,
    role: KVConnectorRole,
    kv_cache_config: KVCacheConfig,
    *,
    registry: ConnectorRegistry | None = None,
) -> C:
    """``connector_class``'s ``role`` side for ``config``, built by a ``KVConnectorContainer``.

    The container's providers build what the class takes (a block
    connector's medium, a composite's children) through ``registry`` (the
    process-wide one by default); ``config`` reaches the connector as it is,
    no HMA gate applied, as the tests driving connectors directly want it.
    The caller shuts the connector down.
    """
    container = container_for_profile(config, kv_cache_config=kv_cache_config, registry=registry)
    container.connector_class.override(providers.Object(connector_class))
    container.connector_engine_config.override(providers.Object(config))
    connector = role_connector_provider(container, role)()
    assert isinstance(connector, connector_class)
    return connector


def read_options(
    connector_class: type[KVConnectorBase],
    kv_transfer_config: KVTransferConfig,
    *,
    registry: ConnectorRegistry | None = None,
) -> tuple[type[Medium], dict[str, Any]]:
    """The medium class and the options a container reads for ``connector_class`` from
    ``kv_transfer_config`` (its ``medium_class`` and ``medium_options`` providers)."""
    container = KVConnectorContainer()
    if registry is not None:
        container.registry.override(providers.Object(registry))
    container.kv_transfer_config.override(providers.Object(kv_transfer_config))
    container.connector_class.override(providers.Object(connector_class))
    medium_class = container.medium_class()
    options = container.medium_options()
    assert medium_class is not None and options is not None
    return medium_class, options


def engine_config(
    connector: str,
    extra: dict[str, Any],
    *,
    kv_role: str = "kv_both",
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 16,
    block_size: int = 4,
    num_blocks: int = 32,
    dtype: str = "float32",
) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(
            num_layers=num_layers,
            num_attention_heads=num_kv_heads * 2,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
        ),
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_role=kv_role, kv_connector_extra_config=extra
        ),
    )


def make_caches(kv_cache_config: KVCacheConfig, seed: int | None = None) -> dict[str, torch.Tensor]:
    """One cache per layer; random content from ``seed``, zeros when None."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    shape = (2, kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    caches = {}
    for name in kv_cache_config.layer_names:
        if generator is None:
            caches[name] = torch.zeros(shape, dtype=getattr(torch, spec.dtype))
        else:
            caches[name] = torch.randn(shape, generator=generator).to(getattr(torch, spec.dtype))
    return caches


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    parent = b"kvwire-tests"
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(block)}q", *block)).digest()
        hashes.append(parent)
    return hashes


def make_request(request_id: str, token_ids: list[int], block_size: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        max_tokens=1,
        block_hashes=block_hashes(token_ids, block_size),
    )


class ConnectorPair:
    """A scheduler-role and a worker-role connector over one set of caches."""

    def __init__(
        self,
        config: EngineConfig,
        connector_class: type[KVConnectorBase],
        caches: dict[str, torch.Tensor],
        *,
        registry: ConnectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_config = cache_config_for(config)
        self.scheduler = build_connector(
            connector_class,
            config,
            KVConnectorRole.SCHEDULER,
            self.kv_cache_config,
            registry=registry,
        )
        self.worker = build_connector(
            connector_class, config, KVConnectorRole.WORKER, self.kv_cache_config, registry=registry
        )
        self.caches = caches
        self.worker.register_kv_caches(caches)
        self.block_size = config.cache_config.block_size
        self.finished_recving: set[str] = set()
        self.finished_sending: set[str] = set()
        self.load_errors: set[int] = set()
        self.stats: dict[str, Any] = {}
        self.nested_stats: dict[str, dict[str, Any]] = {}

    def lookup(self, request: Request, num_local_tokens: int = 0) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_local_tokens)

    def prefill(
        self, request: Request, block_ids: list[int], num_local_tokens: int = 0
    ) -> tuple[int, bool]:
        """Admit ``request`` into ``block_ids``, load what the connector has, compute the rest."""
        matched, is_async = self.lookup(request, num_local_tokens)
        assert matched is not None
        self.scheduler.update_state_after_alloc(request, KVCacheBlocks((list(block_ids),)), matched)
        computed = num_local_tokens + matched
        scheduled = (
            []
            if is_async
            else [
                ScheduledRequest(
                    request_id=request.request_id,
                    block_ids=(list(block_ids),),
                    num_computed_tokens=computed,
                    num_scheduled_tokens=request.num_tokens - computed,
                    is_new=True,
                )
            ]
        )
        self.step(SchedulerOutput(scheduled=scheduled))
        return matched, is_async

    def step(self, output: SchedulerOutput, finished: set[str] | None = None) -> None:
        metadata = pickle.loads(pickle.dumps(self.scheduler.build_connector_meta(output)))
        worker = self.worker
        worker.bind_connector_metadata(metadata)
        layers = tuple(self.caches)
        worker.start_load_kv(ForwardContext(layer_names=layers))
        for name in layers:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, self.caches[name], None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(finished or set())
        self.finished_sending |= sending or set()
        self.finished_recving |= recving or set()
        errors = worker.get_block_ids_with_load_errors()
        self.load_errors |= errors
        stats = worker.get_kv_connector_stats()
        if stats is not None:
            for key, value in stats.data.items():
                if isinstance(value, (int, float)):
                    self.stats[key] = self.stats.get(key, 0) + value
                else:  # a composite's child
                    child = self.nested_stats.setdefault(key, {})
                    for name, count in value.items():
                        child[name] = child.get(name, 0) + count
        worker.clear_connector_metadata()
        self.scheduler.update_connector_output(
            KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                kv_connector_stats=stats,
                invalid_block_ids=errors,
                kv_connector_worker_meta=pickle.loads(
                    pickle.dumps(worker.build_connector_worker_meta())
                ),
            )
        )

    def finish(self, request: Request, block_ids: list[int]) -> bool:
        """End ``request``; step until the connector releases its blocks if it kept them."""
        keep, _ = self.scheduler.request_finished(request, list(block_ids))
        self.step(SchedulerOutput(finished_req_ids={request.request_id}), {request.request_id})
        if keep:
            self.step_until(lambda: request.request_id in self.finished_sending)
        return keep

    def worker_stats_of(self, child: str) -> dict[str, Any]:
        return self.nested_stats.get(child, {})

    def step_until(self, done: Callable[[], bool], limit_s: float = 60.0) -> None:
        """Run empty steps until ``done()``: background work is awaited, never timed."""
        deadline = time.monotonic() + limit_s
        while not done():
            assert time.monotonic() < deadline, "background transfers did not finish"
            time.sleep(0.005)
            self.step(SchedulerOutput())

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def blocks_equal(
    left: dict[str, torch.Tensor],
    left_ids: list[int],
    right: dict[str, torch.Tensor],
    right_ids: list[int],
) -> bool:
    return all(
        torch.equal(left[name][:, lid], right[name][:, rid])
        for name in left
        for lid, rid in zip(left_ids, right_ids, strict=True)
    )
