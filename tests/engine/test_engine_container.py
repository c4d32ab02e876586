"""The engine is assembled by `EngineContainer`: a part is swapped by overriding its provider."""

from __future__ import annotations

import pathlib
import re
from typing import TYPE_CHECKING, Any

import pytest
from dependency_injector import providers

from kvwire.config import EngineConfig
from kvwire.engine import EngineContainer, LLMEngine, build_engine
from kvwire.engine.engine import GenerationRequest
from kvwire.engine.model import TinyTransformer
from kvwire.engine.worker import Worker
from kvwire.interface.base import KVConnectorRole
from kvwire.testing.instruments import CallLog, Instruments
from tests.support.directory_connectors import DirectoryConnector
from tests.support.engines import with_directory_connector

if TYPE_CHECKING:
    import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = [GenerationRequest(f"r{index}", tuple(range(1, 20 + index)), 3) for index in range(3)]


class SubstituteConnector(DirectoryConnector):
    pass


class CountingModel(TinyTransformer):
    forward_passes = 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        self.forward_passes += 1
        return super().forward(*args, **kwargs)


def test_a_connector_class_overridden_in_the_container_serves_both_roles(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    container = EngineContainer(config=with_directory_connector(config, tmp_path))
    container.connectors.connector_class.override(providers.Object(SubstituteConnector))

    with build_engine(container) as engine:
        outputs = engine.generate(PROMPTS)
        assert type(engine.scheduler_connector) is SubstituteConnector
        assert type(engine.worker_connector) is SubstituteConnector
        # Each part is built once per container: the engine holds the container's.
        assert engine.scheduler is container.scheduler()
        assert engine.worker is container.worker()
    with LLMEngine(config) as plain:
        assert [output.output_token_ids for output in outputs] == [
            output.output_token_ids for output in plain.generate(PROMPTS)
        ]


def test_a_model_overridden_in_the_container_is_the_one_the_worker_runs(
    config: EngineConfig,
) -> None:
    container = EngineContainer(config=config)
    worker_parts = container.inline_worker
    worker_parts.model.override(
        providers.Singleton(
            CountingModel,
            config.model_config,
            worker_parts.kv_cache.provided.layer_names,
            config.scheduler_config.max_num_batched_tokens,
            worker_parts.kv_cache.provided.layer_groups,
        )
    )

    with build_engine(container) as engine:
        outputs = engine.generate(PROMPTS)
        model = engine.worker.model  # type: ignore[attr-defined]
        assert isinstance(model, CountingModel) and model.forward_passes > 0
    with LLMEngine(config) as plain:
        assert [output.output_token_ids for output in outputs] == [
            output.output_token_ids for output in plain.generate(PROMPTS)
        ]


def test_the_engines_options_are_the_containers_inputs(config: EngineConfig) -> None:
    container = EngineContainer(config=config, capture_kv=True, idle_timeout_s=5.0)

    with build_engine(container) as engine:
        engine.generate(PROMPTS[:1])
        assert engine.idle_timeout_s == 5.0
        assert set(engine.captured_kv) == {"r0"}
        assert isinstance(engine.worker, Worker)


def test_closing_shuts_the_connectors_down_after_the_final_saves(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    log = CallLog()
    container = EngineContainer(
        config=with_directory_connector(config, tmp_path), connector_hook=Instruments(log=log)
    )
    engine = build_engine(container)
    engine.generate(PROMPTS)
    engine.close()

    calls = [(record.role, record.method) for record in log.records]
    last_wait = max(
        index
        for index, call in enumerate(calls)
        if call == (KVConnectorRole.WORKER, "wait_for_pending_saves")
    )
    shutdowns = [index for index, (_role, method) in enumerate(calls) if method == "shutdown"]
    assert len(shutdowns) == 2 and min(shutdowns) > last_wait
    # Once: the container's resources are the engine's, already shut down.
    container.shutdown_resources()
    assert [record.method for record in log.records].count("shutdown") == 2


def test_a_part_that_fails_to_build_shuts_down_the_connector_built_before_it(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    log = CallLog()
    container = EngineContainer(
        config=with_directory_connector(config, tmp_path), connector_hook=Instruments(log=log)
    )

    def failing_worker() -> Worker:
        raise RuntimeError("the worker could not start")

    container.worker.override(providers.Callable(failing_worker))

    with pytest.raises(RuntimeError, match="could not start"):
        build_engine(container)
    assert log.methods(KVConnectorRole.SCHEDULER)[-1] == "shutdown"


def test_the_docs_engine_container_example_runs() -> None:
    text = (REPO / "docs" / "container.md").read_text()
    blocks = [
        block
        for block in re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
        if "EngineContainer(" in block
    ]
    assert len(blocks) == 1
    namespace: dict[str, Any] = {}

    exec(compile(blocks[0], "docs/container.md engine example", "exec"), namespace)

    engine = namespace["engine"]
    assert type(engine.scheduler_connector).__name__ == "QuietConnector"
    assert len(namespace["outputs"][0].output_token_ids) == 4
    assert set(engine.captured_kv) == {"r0"}
