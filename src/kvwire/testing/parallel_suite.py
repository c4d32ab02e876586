"""The conformance kit's parallel section: a connector under tensor parallelism, in seconds.

Subclass `kvwire.testing.ParallelConformanceSuite`
as you subclass
`kvwire.testing.ConnectorConformanceSuite`,
overriding `engine_config`; each test runs the kvwire engine at
`tensor_parallel_size` 2 (two worker processes, each holding one of the kit
model's two KV heads, its connector built there for its rank) against the
unsplit engine without a connector:

- shards: a TP=2 engine's warm pass is served by its own entries, its
  loaded KV (both ranks' heads put together) bit-identical to the KV
  computed without a connector, its tokens equal;
- cross-size loads: what a TP=1 engine stored loads into a TP=2 engine, and
  what a TP=2 engine stored loads into a TP=1 engine (a connector whose
  entries do not outlive its engine, like CPU offload, sets
  `loads_across_engines = False`: its engines then load nothing of each
  other's, and only equal tokens are asked). A store must name entries so
  that both sizes read them (kvwire's store media: `entry_kv_heads: 1`);
- all or none: a load failed on one rank only (garbage left in the block
  there, the block reported failed) is computed again on every rank, and
  the tokens stay equal.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

import attrs
import pytest
import torch

from kvwire.config import EngineConfig, ParallelConfig
from kvwire.container import container_for_profile
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import renamed_requests
from kvwire.testing.faults import LoadFaultsHook, with_load_faults
from kvwire.testing.instruments import Instruments
from kvwire.testing.suite import ConnectorUnderTest, blocks_workload, run_cold_then_warm

TENSOR_PARALLEL_SIZE = 2


@attrs.frozen
class Computed:
    """A workload's tokens and prompt KV from the unsplit engine without a connector."""

    tokens: list[tuple[int, ...]]
    kv: dict[str, torch.Tensor]


# The unsplit engine's tokens and KV, by model and cache configuration and
# workloads: the same for every connector and every test of one process, so
# computed once (a few kept: a suite uses one or two configurations).
_REFERENCES: OrderedDict[str, Computed] = OrderedDict()
_MAX_REFERENCES = 4


def tensor_parallel(config: EngineConfig, size: int = TENSOR_PARALLEL_SIZE) -> EngineConfig:
    """`config` split over `size` tensor-parallel ranks."""
    return attrs.evolve(config, parallel_config=ParallelConfig(tensor_parallel_size=size))


def _tokens(outputs: Sequence[RequestOutput]) -> list[tuple[int, ...]]:
    return [output.output_token_ids for output in outputs]


def _served(outputs: Sequence[RequestOutput]) -> int:
    return sum(output.external_tokens for output in outputs)


class ParallelConformanceSuite(ConnectorUnderTest):
    """Reusable tests of a connector at tensor parallelism; see the module docstring."""

    loads_across_engines: ClassVar[bool] = True
    """Whether one engine loads what another engine stored (False: entries live in the engine)."""

    @pytest.fixture
    def parallel_workloads(
        self, engine_config: EngineConfig
    ) -> tuple[list[GenerationRequest], list[GenerationRequest]]:
        """Two workloads of four requests sharing a prefix, sharing nothing with each other."""

        def workload(seed: int, name: str) -> list[GenerationRequest]:
            requests = blocks_workload(
                engine_config,
                num_requests=4,
                prompt_blocks=4,
                output_len=3,
                shared_prefix_ratio=0.7,
                seed=seed,
            )
            return renamed_requests(requests, name)

        return workload(21, "first"), workload(22, "second")

    @pytest.fixture
    def parallel_reference(
        self,
        engine_config: EngineConfig,
        parallel_workloads: tuple[list[GenerationRequest], list[GenerationRequest]],
    ) -> Computed:
        """Both workloads' tokens and KV, unsplit and without a connector.

        Computed once per model and cache configuration and workloads in a
        test process, whatever the connector: tests only read it.
        """
        unsplit = attrs.evolve(engine_config, kv_transfer_config=None)
        workload = [*parallel_workloads[0], *parallel_workloads[1]]
        key = repr((unsplit, workload))
        computed = _REFERENCES.get(key)
        if computed is None:
            with LLMEngine(unsplit, capture_kv=True) as engine:
                outputs = engine.generate(workload)
                computed = Computed(_tokens(outputs), dict(engine.captured_kv))
            _REFERENCES[key] = computed
            while len(_REFERENCES) > _MAX_REFERENCES:
                _REFERENCES.popitem(last=False)
        _REFERENCES.move_to_end(key)
        return computed

    def test_parallel_ranks_serve_their_shards_and_load_across_sizes(
        self,
        engine_config: EngineConfig,
        parallel_workloads: tuple[list[GenerationRequest], list[GenerationRequest]],
        parallel_reference: Computed,
        kvwire_strict_roles: bool,
    ) -> None:
        first, second = parallel_workloads
        expected = dict(
            zip([r.request_id for r in (*first, *second)], parallel_reference.tokens, strict=True)
        )
        loads = self.loads_expected(engine_config)
        across = loads and self.loads_across_engines
        hook = Instruments(strict_roles=kvwire_strict_roles)

        with LLMEngine(engine_config, connector_hook=hook) as unsplit:
            assert _tokens(unsplit.generate(first)) == [expected[r.request_id] for r in first]
        with LLMEngine(
            tensor_parallel(engine_config), connector_hook=hook, capture_kv=True
        ) as split:
            from_unsplit = split.generate(first)
            cold, warm = run_cold_then_warm(split, second)
        assert _tokens(from_unsplit) == [expected[r.request_id] for r in first]
        expected_second = [expected[r.request_id] for r in second]
        assert _tokens(cold.outputs) == _tokens(warm.outputs) == expected_second
        if across:
            assert _served(from_unsplit) > 0, "TP=2 loaded nothing a TP=1 engine stored"
        if loads:
            assert _served(warm.outputs) > 0, "the TP=2 warm pass loaded nothing"
        for output in warm.outputs:
            if output.external_tokens:
                request_id = output.request_id.removesuffix("/warm")
                assert torch.equal(
                    warm.captured_kv[request_id], parallel_reference.kv[request_id]
                ), f"{request_id}: the KV the ranks loaded differs from the KV computed unsplit"

        with LLMEngine(engine_config, connector_hook=hook) as unsplit:
            from_split = unsplit.generate(renamed_requests(second, "unsplit"))
        assert _tokens(from_split) == [expected[r.request_id] for r in second]
        if across:
            assert _served(from_split) > 0, "TP=1 loaded nothing a TP=2 engine stored"

    def test_parallel_a_load_failed_on_one_rank_is_computed_again_on_every_rank(
        self,
        engine_config: EngineConfig,
        parallel_workloads: tuple[list[GenerationRequest], list[GenerationRequest]],
        parallel_reference: Computed,
        kvwire_strict_roles: bool,
    ) -> None:
        config = tensor_parallel(engine_config)
        workload = parallel_workloads[0]
        # The scheduler half picks each request's first load's first block;
        # only rank 1 leaves garbage in it and reports it failed.
        rank_one = frozenset({1})
        with LLMEngine(
            config,
            connector_hook=Instruments(strict_roles=kvwire_strict_roles),
            container=with_load_faults(container_for_profile(config), ranks=rank_one),
            worker_container_hook=LoadFaultsHook(ranks=rank_one),
        ) as engine:
            cold, warm = run_cold_then_warm(engine, workload)
        reference = parallel_reference.tokens[: len(workload)]
        assert _tokens(cold.outputs) == reference
        if self.loads_expected(engine_config):
            assert any(output.num_load_failures for output in warm.outputs), (
                "no load happened, so no failure could be injected"
            )
        assert all(output.error is None for output in warm.outputs)
        assert _tokens(warm.outputs) == reference, (
            "a block whose load failed on one rank was not computed again on every rank"
        )
