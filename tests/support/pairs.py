"""Connectors driven directly, both halves, over real paged-cache tensors.

Pairs on a full-attention or a hybrid cache, the fixtures that open them, and
MultiConnectors built through the default registry as in service.
"""

from __future__ import annotations

import hashlib
import pathlib
import pickle
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import attrs
import pytest
import torch
from dependency_injector import providers

from kvwire.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvwire.config.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from kvwire.connectors.multi import MultiConnector
from kvwire.connectors.offload import OffloadConnector, SharedStorageConnector
from kvwire.container import (
    container_for_profile,
    role_connector_provider,
)
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.engine.engine import build_kv_cache_config as cache_config_for
from kvwire.engine.presets import apply_preset
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.interface.types import (
    ForwardContext,
    KVCacheBlocks,
    KVConnectorOutput,
    Request,
    ScheduledRequest,
    SchedulerOutput,
)
from kvwire.media.base import MediumIndex
from kvwire.registry import ConnectorRegistry
from tests.support.engines import (
    generate,
    renamed,
    tiny_config,
    tokens,
    with_connector,
)

# Drives connectors directly, both roles, over real paged-cache tensors.
#
# The scheduler side and the worker side are separate instances, and the
# metadata crosses between them pickled, as it would between processes. The
# caches have the engine's own layout (``cache_config_for`` is the engine's).

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


# A hybrid cache for connector tests: a full-attention KV cache group and a sliding-window one.
#
# The cache config is built as a hybrid engine lays it out: two groups of two
# layers, block ids drawn from one pool, block id 0 the null block that a
# sliding-window group's positions outside its window hold. Each layer has a
# cache of its own (an engine may share memory between groups' layers; here a
# copy from or into the wrong group's layers would show).
#
# CPU offload's tests and the store connectors' contract build their pairs on
# it, and share the tiny-hybrid engine checks at the end, so both are held to
# the same layout and the same rules.

BLOCK = 4
NUM_BLOCKS = 64
# The token at p attends [p - 8, p]: a prefix's last two blocks (ceil(8 / 4)).
WINDOW = 9
FULL, SLIDING = 0, 1
FULL_LAYERS = ["layers.1.attn", "layers.3.attn"]
SLIDING_LAYERS = ["layers.0.attn", "layers.2.attn"]
PROMPT = list(range(100, 125))  # 6 full blocks and one token to compute
SHAPE: dict[str, Any] = {
    "block_size": BLOCK,
    "num_kv_heads": 2,
    "head_size": 16,
    "dtype": "float32",
}

# Request a's blocks: every position allocated in both groups while it prefills.
A_IDS = ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14])
# Request b's: its hit's positions outside the window are the null block.
B_IDS = ([21, 22, 23, 24, 25, 26, 27], [0, 0, 0, 0, 32, 33, 34])


def hybrid_kv_cache_config() -> KVCacheConfig:
    full = FullAttentionSpec(**SHAPE)
    sliding = SlidingWindowSpec(sliding_window=WINDOW, **SHAPE)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size_bytes=full.page_size_bytes * NUM_BLOCKS, shared_by=[name])
            for name in sorted(FULL_LAYERS + SLIDING_LAYERS)
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=list(FULL_LAYERS), kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=list(SLIDING_LAYERS), kv_cache_spec=sliding),
        ],
    )


def hybrid_engine_config(connector: str, extra: dict[str, Any]) -> EngineConfig:
    return engine_config(connector, extra, num_layers=4, block_size=BLOCK, num_blocks=NUM_BLOCKS)


OffloadC = TypeVar("OffloadC", bound=OffloadConnector)


def scheduler_index(connector: OffloadConnector) -> MediumIndex:
    """The index of the medium that a scheduler-role ``connector``'s half keeps."""
    half = connector._scheduler
    assert half is not None, f"{connector!r} has no scheduler half"
    return half.index


class HybridPair(ConnectorPair, Generic[OffloadC]):
    """A scheduler-role and a worker-role connector of one class over a hybrid cache."""

    scheduler: OffloadC
    worker: OffloadC

    def __init__(self, connector_class: type[OffloadC], config: EngineConfig) -> None:
        # Not ConnectorPair.__init__: it derives a single-group cache config from ``config``.
        self.config = config
        self.kv_cache_config = hybrid_kv_cache_config()
        self.scheduler = build_connector(
            connector_class, config, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )
        self.worker = build_connector(
            connector_class, config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.caches = make_caches(self.kv_cache_config, seed=3)
        self.worker.register_kv_caches(self.caches)
        self.block_size = BLOCK
        self.finished_recving: set[str] = set()
        self.finished_sending: set[str] = set()
        self.load_errors: set[int] = set()
        self.stats: dict[str, Any] = {}
        self.nested_stats: dict[str, dict[str, Any]] = {}

    def admit(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[int, bool]:
        """Look ``request`` up and allocate ``block_ids`` (one list per group); the hit."""
        matched, is_async = self.lookup(request)
        assert matched is not None
        self.scheduler.update_state_after_alloc(
            request, KVCacheBlocks(tuple(list(ids) for ids in block_ids)), matched
        )
        return matched, is_async

    def compute(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        computed: int,
        scheduled: int,
        *,
        is_new: bool,
    ) -> None:
        """One step computing ``scheduled`` tokens of ``request`` after ``computed`` ones."""
        item = ScheduledRequest(
            request_id=request.request_id,
            block_ids=tuple(list(ids) for ids in block_ids),
            num_computed_tokens=computed,
            num_scheduled_tokens=scheduled,
            is_new=is_new,
        )
        self.step(SchedulerOutput(scheduled=[item]))

    def prefill_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[int, bool]:
        """Admit ``request``, load what the connector has and compute the rest in one step."""
        matched, is_async = self.admit(request, block_ids)
        if not is_async:
            self.compute(request, block_ids, matched, request.num_tokens - matched, is_new=True)
        return matched, is_async

    def finish_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> bool:
        """End ``request`` as a hybrid engine does; whether the connector kept its blocks.

        Kept blocks are stepped on until the request is finished sending.
        """
        keep, _ = self.scheduler.request_finished_all_groups(
            request, tuple(list(ids) for ids in block_ids)
        )
        self.step(SchedulerOutput(finished_req_ids={request.request_id}), {request.request_id})
        if keep:
            self.step_until(lambda: request.request_id in self.finished_sending)
        return keep

    @property
    def index(self) -> MediumIndex:
        """The scheduler-role connector's index of its medium: what lookups see."""
        return scheduler_index(self.scheduler)

    def held(self, group: int, request: Request, positions: range) -> list[int]:
        """Which of ``positions`` of ``request``'s blocks the connector holds for ``group``."""
        return [
            position
            for position in positions
            if self.index.count_held_prefix(group, request.block_hashes[position : position + 1])
        ]

    def group_blocks(self, group: int, block_id: int) -> list[torch.Tensor]:
        layers = FULL_LAYERS if group == FULL else SLIDING_LAYERS
        return [self.caches[name][:, block_id] for name in layers]


def zero(pair: HybridPair[Any], block_ids: tuple[list[int], ...]) -> None:
    """Zero ``block_ids`` (one list per group) in every layer, the null block left alone."""
    for ids in block_ids:
        for block in ids:
            if block:
                for cache in pair.caches.values():
                    cache[:, block] = 0


# ------------------------------------------------------ tiny-hybrid engine checks

Options = Callable[[str], dict[str, Any]]
"""A connector's ``kv_connector_extra_config`` for a run, given a name unique to that run."""


def assert_block_aligned_prompts_load_as_many_tokens_with_hma_on_as_off(
    connector: str, options: Options, *, settle: bool
) -> None:
    """Warm, block-aligned prompts load the same tokens with HMA on and off.

    Prompts of exactly ten blocks, none shared (so every hit is the
    connector's): a warm prompt recomputes its last token, so its hit ends
    at block 9, and the sliding group must hold the window ending there.
    ``settle`` waits for the cold pass's saves before the warm one (for
    connectors whose saves outlive their requests).
    """
    requests = synthetic_workload(
        WorkloadSpec(
            num_requests=4, prompt_len=40, output_len=4, shared_prefix_ratio=0.0, vocab_size=300
        )
    )
    hybrid_config = apply_preset(tiny_config(), "tiny-hybrid")
    reference = tokens(generate(hybrid_config, requests))
    hma_off = attrs.evolve(
        hybrid_config,
        scheduler_config=attrs.evolve(
            hybrid_config.scheduler_config, disable_hybrid_kv_cache_manager=True
        ),
    )
    loaded: dict[bool, list[int]] = {}
    for hma, model_config in ((True, hybrid_config), (False, hma_off)):
        config = with_connector(model_config, connector, options(f"hma-{hma}"))
        with LLMEngine(config) as engine:
            assert engine.hma_enabled is hma
            engine.generate(requests)
            if settle:
                engine.wait_for_saves()  # the warm pass finds every cold save
            engine.reset_prefix_cache()
            warm = engine.generate(renamed(requests, "-warm"))
        assert tokens(warm) == reference
        loaded[hma] = [output.external_tokens for output in warm]
    assert loaded[True] == loaded[False] == [36] * len(requests)


def assert_a_tail_shorter_than_the_window_after_a_shared_prefix_hits_warm(
    connector: str, options: Options, *, settle: bool
) -> None:
    """A request branching off a shared prefix with a short tail gets its whole prompt warm.

    b shares a's first 6 blocks and adds 5 tokens, fewer than the window
    (8): its own step's window reaches back into the shared prefix, whose
    window a saved only at its own end. b saves the window at its branch
    point (it held it, from its local hit), so warm, with the engine's own
    cache empty, b finds all 7 full blocks (its last token is computed).
    """
    long = tuple((7 * i + 3) % 300 for i in range(40))
    a = GenerationRequest("a", long, 4)
    b = GenerationRequest("b", (*long[:24], 299, 298, 297, 296, 295), 4)
    hybrid_config = apply_preset(tiny_config(), "tiny-hybrid")
    reference = tokens(generate(hybrid_config, [a, b]))
    config = with_connector(hybrid_config, connector, options("tail"))
    with LLMEngine(config) as engine:
        assert engine.hma_enabled
        cold = engine.generate([a]) + engine.generate([b])
        if settle:
            engine.wait_for_saves()  # the warm pass finds every cold save
        engine.reset_prefix_cache()
        warm = engine.generate(renamed([b], "-warm"))
    assert [output.local_cached_tokens for output in cold] == [0, 24]
    assert tokens(cold) == reference
    assert [output.external_tokens for output in warm] == [28]
    assert tokens(warm) == reference[1:]


# Fixtures that open connector pairs: a scheduler half and a worker half over one medium.

PairFactory = Callable[..., ConnectorPair]
OpenPair = Callable[..., ConnectorPair]


@pytest.fixture
def storage_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "kv-store"


@pytest.fixture
def open_pair() -> Iterator[OpenPair]:
    """Opens connector pairs over caches of ``seed``'s random content; shuts them all down.

    Called as ``open_pair(config, connector_class, seed, registry=None)``: each
    side is built by a container over ``registry`` (the process-wide one by default).
    """
    pairs: list[ConnectorPair] = []

    def open_one(
        config: EngineConfig,
        connector_class: type[KVConnectorBase],
        seed: int | None,
        registry: ConnectorRegistry | None = None,
    ) -> ConnectorPair:
        caches = make_caches(cache_config_for(config), seed)
        pair = ConnectorPair(config, connector_class, caches, registry=registry)
        pairs.append(pair)
        return pair

    yield open_one
    for pair in pairs:
        pair.shutdown()


@pytest.fixture
def shared_storage_pair(storage_dir: pathlib.Path, open_pair: OpenPair) -> PairFactory:
    """Builds shared-storage connector pairs on one directory."""

    def build(seed: int | None = None, **options: object) -> ConnectorPair:
        kv_role = str(options.pop("kv_role", "kv_both"))
        extra = {
            "shared_storage_path": str(storage_dir),
            "max_save_bytes_in_flight": "1MiB",
            **options,
        }
        config: EngineConfig = engine_config("SharedStorageConnector", extra, kv_role=kv_role)
        return open_pair(config, SharedStorageConnector, seed)

    return build


# Builds a MultiConnector, its children through the default registry as in service.


def build_multi(role: KVConnectorRole, extra: dict[str, Any]) -> MultiConnector:
    """The ``role`` side of a MultiConnector whose extra config is ``extra``."""
    config = engine_config("MultiConnector", extra)
    return build_connector(MultiConnector, config, role, cache_config_for(config))
