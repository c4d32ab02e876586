"""The conformance suite: any connector, taken through the engine as a server would.

Subclass `kvwire.testing.ConnectorConformanceSuite` in a `Test*` class
and override the `engine_config` fixture to name your connector:

```python
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config

class TestMyConnector(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path):
        return conformance_engine_config(
            "MyConnector", extra_config={"path": str(tmp_path)}
        )
```

pytest then runs every `test_*` below on it: the call order of both roles,
equal outputs with and without the connector (cold and warm), a bit-exact
round trip of KV blocks, the async-load path, load failures under both
policies, preemption, the worker in its own process, and shutdown. Strict
roles are on (`--kvwire-no-strict-roles` turns them off).

Hybrid models (the `test_hybrid_*` tests): the same connector config runs
a tiny model whose layers alternate sliding-window and full attention
(`kvwire.testing.hybrid_engine_config`, the HMA gate left to
decide). For a connector that serves HMA (`SupportsHMA`, or a composite
whose `supports_hma_for_config` says so) the engine keeps one KV cache
group per kind of layer, and the kit checks:

- every group's KV round trips bit-exactly (warm, loaded, against the same
  model computed without a connector), and outputs are equal;
- only blocks inside a sliding-window group's window move: the null block
  (id 0, the positions that left the window) is never written, and where
  the connector reports `bytes_saved` / `bytes_loaded` in its stats
  (summed through a composite's children), each is smaller with HMA on
  than with HMA off (one group of every layer, every block moved), as a
  connector that moved every block of every group would not be;
- a warm prompt equal to a cold one hits at least as many tokens with HMA
  on as with HMA off, a prompt of whole blocks included (the engine
  recomputes its last token, so its hit ends a block before the saved
  prefix's end, and a sliding-window group must hold the window there);
- blocks a connector keeps at `request_finished_all_groups` stay
  allocated in every group (no other request gets one) until the connector
  reports the request finished sending, and it does report every one.

A connector that does not serve HMA is, by design, not given a hybrid
cache: these tests then check that the gate turned HMA off (with its
reason), that the hybrid model ran with one KV cache group and that outputs
are still equal; the per-group checks need HMA and do not apply to it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch

from kvwire.config import EngineConfig, LoadFailurePolicy
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.container import container_for_profile
from kvwire.engine.block_manager import NULL_BLOCK
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.worker import Worker
from kvwire.engine.workload import WorkloadSpec, renamed_requests, synthetic_workload
from kvwire.hma import HMADecision
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import RequestStatus
from kvwire.testing.configs import (
    hybrid_engine_config,
    with_hma_disabled,
    with_load_failure_policy,
)
from kvwire.testing.faults import with_load_faults
from kvwire.testing.instruments import CallLog, Instruments

_WORKER_CODES = {
    "register_kv_caches": "R",
    "get_handshake_metadata": "H",
    "bind_connector_metadata": "B",
    "start_load_kv": "S",
    "wait_for_layer_load": "W",
    "save_kv_layer": "V",
    "wait_for_save": "F",
    "get_finished": "G",
    "get_block_ids_with_load_errors": "E",
    "get_kv_connector_stats": "K",
    "get_kv_connector_kv_cache_events": "Q",
    "clear_connector_metadata": "C",
    "wait_for_pending_saves": "P",
    "shutdown": "X",
}
# Register once, then the handshake metadata; per step: bind, start loading,
# per layer (wait, save), wait for saves, the reports and clear. Between steps
# and before shutdown (the engine waits for saves that outlive their step when
# asked to and when it closes): wait for them, then their stats and events.
# Last shutdown, and the stats of the transfers shutdown let finish.
_STEP = r"BS(?:WV)*FGEKQC"
_WORKER_LIFECYCLE = re.compile(rf"RH{_STEP}(?:{_STEP}|PKQ)*XK")


@attrs.frozen
class PassResult:
    """One pass of the workload through an engine with the connector."""

    outputs: list[RequestOutput]
    captured_kv: dict[str, torch.Tensor]


@attrs.frozen
class HybridRun:
    """A cold and a warm pass on a hybrid config, and what the engine made of it.

    `layer_groups` is each layer's KV cache group (model order, as captured
    KV stacks layers); `stats` the connector's summed stats;
    `null_block_written`: whether any layer's null block (id 0) holds
    anything but zeros afterwards (only with a null block, i.e. HMA on).
    """

    hma: HMADecision
    kv_cache_config: KVCacheConfig
    layer_groups: tuple[int, ...]
    cold: PassResult
    warm: PassResult
    stats: dict[str, Any]
    null_block_written: bool

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_config.kv_cache_groups)


def summed_counter(stats: Any, name: str) -> float | None:
    """`name`'s value in connector stats, summed over a composite's children; else None."""
    if not isinstance(stats, dict):
        return None
    found = [stats[name]] if isinstance(stats.get(name), (int, float)) else []
    found += [
        value
        for child in stats.values()
        if isinstance(child, dict) and (value := summed_counter(child, name)) is not None
    ]
    return sum(found) if found else None


class ConnectorUnderTest:
    """What a conformance suite needs of its subclass: the engine config naming the connector."""

    @pytest.fixture
    def engine_config(self, tmp_path: Any) -> EngineConfig:
        raise NotImplementedError(
            f"{type(self).__name__} must override the engine_config(self, tmp_path) fixture "
            "to return an EngineConfig whose kv_transfer_config names the connector"
        )

    @staticmethod
    def loads_expected(config: EngineConfig) -> bool:
        """A connector that both saves and loads must serve the warm pass."""
        transfer = config.kv_transfer_config
        return transfer is not None and transfer.is_kv_producer and transfer.is_kv_consumer


def run_cold_then_warm(
    engine: LLMEngine, workload: Sequence[GenerationRequest]
) -> tuple[PassResult, PassResult]:
    """Run `workload` on `engine` cold, then warm under ids of its own, its local cache emptied.

    Each pass's saves are waited for: a save may outlive its request
    (written in the background), and a warm pass racing it would find
    nothing to load. The warm pass's KV is keyed by the cold pass's ids.
    """
    cold = engine.generate(workload)
    engine.wait_for_saves()
    cold_kv = dict(engine.captured_kv)
    assert engine.reset_prefix_cache(), "blocks still held after the cold pass"
    warm = engine.generate(renamed_requests(workload, "warm"))
    engine.wait_for_saves()
    warm_kv = {
        request_id.removesuffix("/warm"): kv
        for request_id, kv in engine.captured_kv.items()
        if request_id.endswith("/warm")
    }
    return PassResult(cold, cold_kv), PassResult(warm, warm_kv)


def blocks_workload(
    config: EngineConfig,
    *,
    num_requests: int,
    prompt_blocks: int,
    output_len: int,
    shared_prefix_ratio: float,
    seed: int,
) -> list[GenerationRequest]:
    """Requests whose prompts are `prompt_blocks` blocks and a half long, plus a token."""
    block_size = config.cache_config.block_size
    spec = WorkloadSpec(
        num_requests=num_requests,
        prompt_len=prompt_blocks * block_size + block_size // 2 + 1,
        output_len=output_len,
        shared_prefix_ratio=shared_prefix_ratio,
        vocab_size=config.model_config.vocab_size,
        seed=seed,
    )
    return synthetic_workload(spec)


class ConnectorConformanceSuite(ConnectorUnderTest):
    """Reusable tests every KV connector must pass; see the module docstring."""

    @pytest.fixture
    def conformance_workload(self, engine_config: EngineConfig) -> list[GenerationRequest]:
        """Six requests sharing most of a prompt that ends mid-block."""
        return blocks_workload(
            engine_config,
            num_requests=6,
            prompt_blocks=4,
            output_len=4,
            shared_prefix_ratio=0.7,
            seed=11,
        )

    @pytest.fixture
    def reference_outputs(
        self, engine_config: EngineConfig, conformance_workload: list[GenerationRequest]
    ) -> list[tuple[int, ...]]:
        """The tokens the same model generates without any connector."""
        with LLMEngine(attrs.evolve(engine_config, kv_transfer_config=None)) as engine:
            return [output.output_token_ids for output in engine.generate(conformance_workload)]

    @pytest.fixture
    def hybrid_config(self, engine_config: EngineConfig) -> EngineConfig:
        """`engine_config` with the kit's tiny hybrid model; the HMA gate decides."""
        return hybrid_engine_config(engine_config)

    # ------------------------------------------------------------ helpers

    @staticmethod
    def cold_then_warm(
        config: EngineConfig,
        workload: Sequence[GenerationRequest],
        hook: Instruments,
        **engine_options: Any,
    ) -> tuple[PassResult, PassResult]:
        """Run `workload` twice on one engine, emptying its local cache in between.

        Each pass's saves are waited for; the warm pass runs under ids of its
        own, and its captured KV is keyed by the cold pass's ids.
        """
        with LLMEngine(config, connector_hook=hook, **engine_options) as engine:
            return run_cold_then_warm(engine, workload)

    @classmethod
    def hybrid_cold_then_warm(
        cls, config: EngineConfig, workload: Sequence[GenerationRequest], hook: Instruments
    ) -> HybridRun:
        """`kvwire.testing.ConnectorConformanceSuite.cold_then_warm` on a hybrid
        config (worker inline), with what HMA decided."""
        with LLMEngine(config, connector_hook=hook, capture_kv=True) as engine:
            cold, warm = run_cold_then_warm(engine, workload)
            worker = engine.worker
            assert isinstance(worker, Worker)
            null_block_written = engine.scheduler.block_manager.uses_null_block and any(
                bool(cache[:, NULL_BLOCK].any()) for cache in worker.kv_caches.values()
            )
        return HybridRun(
            hma=engine.hma,
            kv_cache_config=engine.kv_cache_config,
            layer_groups=worker.layer_groups,
            cold=cold,
            warm=warm,
            stats=dict(engine.connector_stats.data),
            null_block_written=null_block_written,
        )

    @staticmethod
    def assert_hma_turned_off(run: HybridRun, reference: Sequence[tuple[int, ...]]) -> None:
        """What the hybrid tests check of a connector that does not serve HMA."""
        assert not run.hma.enabled, run.hma.reason
        assert "does not support HMA: HMA is turned off" in run.hma.reason, run.hma.reason
        assert run.num_groups == 1
        assert [o.output_token_ids for o in run.cold.outputs] == list(reference)
        assert [o.output_token_ids for o in run.warm.outputs] == list(reference)

    @staticmethod
    def logged_pass(
        config: EngineConfig, workload: Sequence[GenerationRequest], strict_roles: bool
    ) -> tuple[CallLog, LLMEngine]:
        """Run `workload` once with every connector call logged; the engine comes back closed."""
        log = CallLog()
        with LLMEngine(
            config, connector_hook=Instruments(strict_roles=strict_roles, log=log)
        ) as engine:
            engine.generate(workload)
        return log, engine

    # ------------------------------------------------------------ the suite

    def test_outputs_equal_without_connector_cold_and_warm(
        self,
        engine_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        reference_outputs: list[tuple[int, ...]],
        kvwire_instruments: Instruments,
    ) -> None:
        cold, warm = self.cold_then_warm(engine_config, conformance_workload, kvwire_instruments)
        assert [o.output_token_ids for o in cold.outputs] == reference_outputs
        assert [o.output_token_ids for o in warm.outputs] == reference_outputs
        if self.loads_expected(engine_config):
            assert sum(o.external_tokens for o in warm.outputs) > 0, "the warm pass loaded nothing"

    def test_loaded_blocks_are_bit_identical_to_computed_ones(
        self,
        engine_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        kvwire_instruments: Instruments,
    ) -> None:
        no_connector = attrs.evolve(engine_config, kv_transfer_config=None)
        with LLMEngine(no_connector, capture_kv=True) as engine:
            engine.generate(conformance_workload)
            computed = engine.captured_kv
        _cold, warm = self.cold_then_warm(
            engine_config, conformance_workload, kvwire_instruments, capture_kv=True
        )
        loaded = [o for o in warm.outputs if o.external_tokens > 0]
        if self.loads_expected(engine_config):
            assert loaded, "the warm pass loaded nothing"
        for output in loaded:
            request_id = output.request_id.removesuffix("/warm")
            assert torch.equal(warm.captured_kv[request_id], computed[request_id]), request_id

    def test_scheduler_role_calls_follow_the_lifecycle(
        self,
        engine_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        kvwire_strict_roles: bool,
    ) -> None:
        log, engine = self.logged_pass(engine_config, conformance_workload, kvwire_strict_roles)
        steps = engine.counters.steps
        calls = log.of_role(KVConnectorRole.SCHEDULER)
        methods = [call.method for call in calls]
        assert methods.count("build_connector_meta") == steps
        assert methods[-1] == "shutdown" and methods.count("shutdown") == 1
        looked_up: set[str] = set()
        allocated: set[str] = set()
        finished: list[str] = []
        for call in calls:
            if call.method == "get_num_new_matched_tokens":
                looked_up.add(call.detail)
            elif call.method == "update_state_after_alloc":
                assert call.detail in looked_up, f"{call.detail}: allocated before any lookup"
                allocated.add(call.detail)
            elif call.method in ("request_finished", "request_finished_all_groups"):
                assert call.detail in allocated, f"{call.detail}: finished before allocation"
                finished.append(call.detail)
        assert sorted(finished) == sorted(r.request_id for r in conformance_workload)

    def test_worker_role_calls_follow_the_lifecycle(
        self,
        engine_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        kvwire_strict_roles: bool,
    ) -> None:
        log, engine = self.logged_pass(engine_config, conformance_workload, kvwire_strict_roles)
        layer_names = list(engine.kv_cache_config.layer_names)
        calls = [c for c in log.of_role(KVConnectorRole.WORKER) if c.method in _WORKER_CODES]
        sequence = "".join(_WORKER_CODES[call.method] for call in calls)
        assert _WORKER_LIFECYCLE.fullmatch(sequence), f"worker call order: {sequence}"
        step_layers: list[str] = []
        for call in calls:
            if call.method == "wait_for_layer_load":
                step_layers.append(call.detail)
            elif call.method == "wait_for_save":
                assert step_layers in ([], layer_names), f"layers in a step: {step_layers}"
                step_layers = []

    def test_async_loads_park_requests_until_received(
        self,
        engine_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        kvwire_strict_roles: bool,
    ) -> None:
        log = CallLog()
        hook = Instruments(strict_roles=kvwire_strict_roles, log=log)
        self.cold_then_warm(engine_config, conformance_workload, hook)
        async_requests: set[str] = set()
        received: set[str] = set()
        for call in log.records:
            if call.method == "get_num_new_matched_tokens" and call.result[1]:
                async_requests.add(call.detail)
            elif call.method == "get_finished" and call.result[1]:
                unknown = set(call.result[1]) - async_requests
                assert not unknown, f"reported received without an async load: {unknown}"
                received |= set(call.result[1])
            elif call.method == "build_connector_meta":
                early = (set(call.detail) & async_requests) - received
                assert not early, f"scheduled before their async load was received: {early}"
        assert received == async_requests

    @pytest.mark.parametrize("policy", ["recompute", "fail"])
    def test_failed_loads_follow_the_load_failure_policy(
        self,
        engine_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        reference_outputs: list[tuple[int, ...]],
        kvwire_instruments: Instruments,
        policy: LoadFailurePolicy,
    ) -> None:
        config = with_load_failure_policy(engine_config, policy)
        # Every request's first load fails at its first block, whatever the connector.
        _cold, warm = self.cold_then_warm(
            config,
            conformance_workload,
            kvwire_instruments,
            container=with_load_faults(container_for_profile(config), block_index=0),
        )
        failed = [o for o in warm.outputs if o.num_load_failures]
        if self.loads_expected(engine_config):
            assert failed, "no load happened, so no failure could be injected"
        for output, expected in zip(warm.outputs, reference_outputs, strict=True):
            if policy == "fail" and output.num_load_failures:
                assert output.status is RequestStatus.FINISHED_ERROR
                assert output.error is not None and repr(output.request_id) in output.error
                assert "failed to load KV blocks [" in output.error
            else:
                assert output.error is None
                assert output.output_token_ids == expected

    def test_preemption_keeps_outputs_equal(
        self,
        engine_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        reference_outputs: list[tuple[int, ...]],
        kvwire_instruments: Instruments,
    ) -> None:
        block_size = engine_config.cache_config.block_size
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in conformance_workload)
        # Room for two requests at most: the others preempt each other.
        blocks = 2 * -(-longest // block_size) + 1
        small = attrs.evolve(
            engine_config,
            cache_config=attrs.evolve(engine_config.cache_config, num_gpu_blocks=blocks),
        )
        with LLMEngine(small, connector_hook=kvwire_instruments) as engine:
            outputs = engine.generate(conformance_workload)
            assert engine.counters.preemptions > 0
        assert [o.output_token_ids for o in outputs] == reference_outputs

    def test_worker_in_its_own_process_gives_equal_outputs(
        self,
        engine_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        reference_outputs: list[tuple[int, ...]],
        kvwire_strict_roles: bool,
    ) -> None:
        hook = Instruments(strict_roles=kvwire_strict_roles)
        cold, warm = self.cold_then_warm(
            engine_config, conformance_workload, hook, worker_mode="process"
        )
        assert [o.output_token_ids for o in cold.outputs] == reference_outputs
        assert [o.output_token_ids for o in warm.outputs] == reference_outputs

    def test_shutdown_is_called_once_per_role_and_only_last_stats_follow(
        self, engine_config: EngineConfig, conformance_workload: list[GenerationRequest]
    ) -> None:
        log = CallLog()
        engine = LLMEngine(engine_config, connector_hook=Instruments(log=log))
        engine.generate(conformance_workload[:2])
        engine.close()
        engine.close()
        # Only the worker's last stats (what shutdown let finish) follow its shutdown.
        last_calls = {
            KVConnectorRole.SCHEDULER: ["shutdown"],
            KVConnectorRole.WORKER: ["shutdown", "get_kv_connector_stats"],
        }
        for role, last in last_calls.items():
            methods = log.methods(role)
            assert methods.count("shutdown") == 1 and methods[-len(last) :] == last, role

    # ------------------------------------------------------- hybrid models

    @pytest.fixture
    def hybrid_reference(
        self, hybrid_config: EngineConfig, conformance_workload: list[GenerationRequest]
    ) -> tuple[list[tuple[int, ...]], dict[str, torch.Tensor]]:
        """The hybrid model's tokens and prompt KV without a connector (HMA on)."""
        no_connector = attrs.evolve(hybrid_config, kv_transfer_config=None)
        with LLMEngine(no_connector, capture_kv=True) as engine:
            outputs = engine.generate(conformance_workload)
            assert engine.hma.enabled and len(engine.kv_cache_config.kv_cache_groups) > 1
            return [o.output_token_ids for o in outputs], dict(engine.captured_kv)

    def test_hybrid_model_round_trips_every_kv_cache_group_bit_exactly(
        self,
        hybrid_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        hybrid_reference: tuple[list[tuple[int, ...]], dict[str, torch.Tensor]],
        kvwire_instruments: Instruments,
    ) -> None:
        reference, computed = hybrid_reference
        run = self.hybrid_cold_then_warm(hybrid_config, conformance_workload, kvwire_instruments)
        if not run.hma.enabled:
            self.assert_hma_turned_off(run, reference)
            return
        assert run.num_groups > 1, "HMA on, but the hybrid model got one KV cache group"
        loaded = [o for o in run.warm.outputs if o.external_tokens > 0]
        if self.loads_expected(hybrid_config):
            assert loaded, "the warm pass loaded nothing"
        # KV first: a group loaded wrong names itself here, before the outputs diverge.
        for output in loaded:
            request_id = output.request_id.removesuffix("/warm")
            for group in range(run.num_groups):
                layers = [i for i, g in enumerate(run.layer_groups) if g == group]
                assert torch.equal(
                    run.warm.captured_kv[request_id][layers], computed[request_id][layers]
                ), f"{request_id}: KV cache group {group} (layers {layers}) differs after loading"
        assert [o.output_token_ids for o in run.cold.outputs] == reference
        assert [o.output_token_ids for o in run.warm.outputs] == reference

    @pytest.fixture
    def long_distinct_prompts(self, engine_config: EngineConfig) -> list[GenerationRequest]:
        """Four prompts sharing nothing, four windows long: three of eight blocks
        and a half, the last of exactly eight blocks.

        Nothing shared, so each request saves and loads its own blocks, and
        the local prefix cache (which keeps different blocks with HMA on and
        off) plays no part in what the connector moves. The last prompt's
        warm hit ends a block before its saved prefix's end (the engine
        recomputes a prompt's last token): a connector that keeps only the
        window at the end of what it saved finds no window there.
        """
        *unaligned, last = blocks_workload(
            engine_config,
            num_requests=4,
            prompt_blocks=8,
            output_len=2,
            shared_prefix_ratio=0.0,
            seed=13,
        )
        block_size = engine_config.cache_config.block_size
        aligned = attrs.evolve(last, prompt_token_ids=last.prompt_token_ids[: 8 * block_size])
        return [*unaligned, aligned]

    def test_hybrid_model_moves_only_blocks_inside_the_sliding_window(
        self,
        hybrid_config: EngineConfig,
        long_distinct_prompts: list[GenerationRequest],
        kvwire_instruments: Instruments,
    ) -> None:
        run = self.hybrid_cold_then_warm(hybrid_config, long_distinct_prompts, kvwire_instruments)
        no_connector = attrs.evolve(hybrid_config, kv_transfer_config=None)
        with LLMEngine(no_connector) as engine:
            reference = [o.output_token_ids for o in engine.generate(long_distinct_prompts)]
        if not run.hma.enabled:
            self.assert_hma_turned_off(run, reference)
            return
        assert [o.output_token_ids for o in run.warm.outputs] == reference
        assert not run.null_block_written, (
            "the null block (id 0: positions that left a sliding window) was written: "
            "a connector must never load into it"
        )
        every_block = self.hybrid_cold_then_warm(
            with_hma_disabled(hybrid_config), long_distinct_prompts, kvwire_instruments
        )
        assert every_block.num_groups == 1
        # HMA on stores fewer bytes per prefix, so a medium keeps at least as
        # many prefixes as with HMA off: no hit may be shorter.
        hits_without = {o.request_id: o.external_tokens for o in every_block.warm.outputs}
        for output in run.warm.outputs:
            hit_without = hits_without[output.request_id]
            assert output.external_tokens >= hit_without, (
                f"{output.request_id}: the warm pass loaded {output.external_tokens} tokens with "
                f"HMA on, {hit_without} with one KV cache group of every layer: a sliding-window "
                "group must hold the window at the end of every prefix a later prompt can hit, "
                "a block before the end of a saved prompt of whole blocks included (the engine "
                "recomputes a prompt's last token)"
            )
        # Per loaded token: HMA on and off may load hits of different lengths.
        loaded_tokens = [
            sum(o.external_tokens for o in r.cold.outputs + r.warm.outputs)
            for r in (run, every_block)
        ]
        for counter, per in (("bytes_saved", (1, 1)), ("bytes_loaded", loaded_tokens)):
            with_window = summed_counter(run.stats, counter)
            without = summed_counter(every_block.stats, counter)
            if with_window is None or not without or not all(per):
                continue  # the connector does not report it
            assert with_window / per[0] < without / per[1], (
                f"{counter}: {with_window:g} with HMA on, {without:g} with one KV cache group "
                "of every layer: a sliding-window group must move only the blocks inside its "
                "window, not every block the full-attention groups move"
            )

    def test_hybrid_model_keeps_blocks_in_every_group_until_sent(
        self,
        hybrid_config: EngineConfig,
        conformance_workload: list[GenerationRequest],
        hybrid_reference: tuple[list[tuple[int, ...]], dict[str, torch.Tensor]],
        kvwire_strict_roles: bool,
    ) -> None:
        log = CallLog()
        hook = Instruments(strict_roles=kvwire_strict_roles, log=log)
        run = self.hybrid_cold_then_warm(hybrid_config, conformance_workload, hook)
        if not run.hma.enabled:
            self.assert_hma_turned_off(run, hybrid_reference[0])
            return
        kept: dict[str, set[int]] = {}
        sent: set[str] = set()
        for call in log.records:
            if call.method == "request_finished_all_groups":
                assert len(call.block_ids) == run.num_groups, (
                    f"{call.detail}: block ids of {len(call.block_ids)} groups, "
                    f"the cache has {run.num_groups}"
                )
                if call.result[0]:
                    kept[call.detail] = {b for group in call.block_ids for b in group} - {
                        NULL_BLOCK
                    }
            elif call.method == "request_finished":
                raise AssertionError(
                    f"{call.detail}: request_finished called on an HMA connector with HMA on"
                )
            elif call.method == "get_finished" and call.result[0]:
                for request_id in call.result[0]:
                    kept.pop(request_id, None)
                    sent.add(request_id)
            elif call.method == "build_connector_meta":
                for request_id, groups in call.block_ids:
                    handed = {b for group in groups for b in group}
                    for owner, blocks in kept.items():
                        reused = sorted(handed & blocks)
                        assert not reused, (
                            f"blocks {reused} kept for {owner!r} (not yet finished sending) "
                            f"were given to {request_id!r}"
                        )
        assert not kept, f"kept blocks never reported finished sending: {sorted(kept)}"
