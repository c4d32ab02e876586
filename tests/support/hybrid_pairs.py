"""A hybrid cache for connector tests: a full-attention KV cache group and a sliding-window one.

The cache config is built as a hybrid engine lays it out: two groups of two
layers, block ids drawn from one pool, block id 0 the null block that a
sliding-window group's positions outside its window hold. Each layer has a
cache of its own (an engine may share memory between groups' layers; here a
copy from or into the wrong group's layers would show).

CPU offload's tests and the store connectors' contract build their pairs on
it, and share the tiny-hybrid engine checks at the end, so both are held to
the same layout and the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs
import torch

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from kvwire.connectors.offload import OffloadConnector
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.engine.presets import apply_preset
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import KVCacheBlocks, Request, ScheduledRequest, SchedulerOutput
from kvwire.media.base import MediumIndex
from tests.support.connector_pairs import (
    ConnectorPair,
    build_connector,
    engine_config,
    make_caches,
)
from tests.support.engines import (
    generate,
    renamed,
    tiny_config,
    tokens,
    with_connector,
)

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


C = TypeVar("C", bound=OffloadConnector)


def scheduler_index(connector: OffloadConnector) -> MediumIndex:
    """The index of the medium that a scheduler-role ``connector``'s half keeps."""
    half = connector._scheduler
    assert half is not None, f"{connector!r} has no scheduler half"
    return half.index


class HybridPair(ConnectorPair, Generic[C]):
    """A scheduler-role and a worker-role connector of one class over a hybrid cache."""

    scheduler: C
    worker: C

    def __init__(self, connector_class: type[C], config: EngineConfig) -> None:
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
