"""The conformance suite: any connector, taken through the engine as a server would.

Subclass :class:`ConnectorConformanceSuite` in a ``Test*`` class and override
the ``engine_config`` fixture to name your connector::

    from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config

    class TestMyConnector(ConnectorConformanceSuite):
        @pytest.fixture
        def engine_config(self, tmp_path):
            return conformance_engine_config(
                "MyConnector", extra_config={"path": str(tmp_path)}
            )

pytest then runs every ``test_*`` below on it: the call order of both roles,
equal outputs with and without the connector (cold and warm), a bit-exact
round trip of KV blocks, the async-load path, load failures under both
policies, preemption, the worker in its own process, and shutdown. Strict
roles are on (``--kvwire-no-strict-roles`` turns them off).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch

from kvwire.config import EngineConfig, LoadFailurePolicy
from kvwire.connector.base import KVConnectorRole
from kvwire.connector.types import RequestStatus
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.worker import LoadFailureInjection
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from kvwire.testing.configs import with_load_failure_policy
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


class ConnectorConformanceSuite:
    """Reusable tests every KV connector must pass; see the module docstring."""

    @pytest.fixture
    def engine_config(self, tmp_path: Any) -> EngineConfig:
        raise NotImplementedError(
            f"{type(self).__name__} must override the engine_config(self, tmp_path) fixture "
            "to return an EngineConfig whose kv_transfer_config names the connector"
        )

    @pytest.fixture
    def conformance_workload(self, engine_config: EngineConfig) -> list[GenerationRequest]:
        """Six requests sharing most of a prompt that ends mid-block."""
        block_size = engine_config.cache_config.block_size
        spec = WorkloadSpec(
            num_requests=6,
            prompt_len=4 * block_size + block_size // 2 + 1,
            output_len=4,
            shared_prefix_ratio=0.7,
            vocab_size=engine_config.model_config.vocab_size,
            seed=11,
        )
        return synthetic_workload(spec)

    @pytest.fixture
    def reference_outputs(
        self, engine_config: EngineConfig, conformance_workload: list[GenerationRequest]
    ) -> list[tuple[int, ...]]:
        """The tokens the same model generates without any connector."""
        with LLMEngine(attrs.evolve(engine_config, kv_transfer_config=None)) as engine:
            return [output.output_token_ids for output in engine.generate(conformance_workload)]

    # ------------------------------------------------------------ helpers

    @staticmethod
    def cold_then_warm(
        config: EngineConfig,
        workload: Sequence[GenerationRequest],
        hook: Instruments,
        **engine_options: Any,
    ) -> tuple[PassResult, PassResult]:
        """Run ``workload`` twice on one engine, emptying its local cache in between.

        The cold pass's saves are waited for before the warm pass starts: a
        save may outlive its request (written in the background), and a
        warm pass racing it would find nothing to load.
        """
        with LLMEngine(config, connector_hook=hook, **engine_options) as engine:
            cold = engine.generate(workload)
            engine.wait_for_saves()
            cold_kv = dict(engine.captured_kv)
            assert engine.reset_prefix_cache(), "blocks still held after the cold pass"
            warm_workload = [attrs.evolve(r, request_id=f"{r.request_id}/warm") for r in workload]
            warm = engine.generate(warm_workload)
            warm_kv = {
                request_id.removesuffix("/warm"): kv
                for request_id, kv in engine.captured_kv.items()
                if request_id.endswith("/warm")
            }
        return PassResult(cold, cold_kv), PassResult(warm, warm_kv)

    @staticmethod
    def logged_pass(
        config: EngineConfig, workload: Sequence[GenerationRequest], strict_roles: bool
    ) -> tuple[CallLog, LLMEngine]:
        """Run ``workload`` once with every connector call logged; the engine comes back closed."""
        log = CallLog()
        with LLMEngine(
            config, connector_hook=Instruments(strict_roles=strict_roles, log=log)
        ) as engine:
            engine.generate(workload)
        return log, engine

    @staticmethod
    def loads_expected(config: EngineConfig) -> bool:
        """A connector that both saves and loads must serve the warm pass."""
        transfer = config.kv_transfer_config
        return transfer is not None and transfer.is_kv_producer and transfer.is_kv_consumer

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
        _cold, warm = self.cold_then_warm(
            config,
            conformance_workload,
            kvwire_instruments,
            load_failure_injection=LoadFailureInjection(block_index=0),
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
