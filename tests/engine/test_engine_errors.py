"""Bad requests and misbehaving connectors get clear errors, never a hang or garbage."""

from __future__ import annotations

import pathlib
import time

import attrs
import pytest
from dependency_injector import providers

from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.container import KVConnectorContainer
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.registry import ModulePathError
from kvwire.testing.instruments import Instruments, RoleViolationError
from tests.support.directory_connectors import DirectoryConnector
from tests.support.engines import generate, tiny_config, with_directory_connector

PROMPT = GenerationRequest("r", tuple(range(1, 20)), 2)


def _misbehaving(
    config: EngineConfig, store: pathlib.Path, class_name: str, **flags: bool
) -> EngineConfig:
    connector_config = with_directory_connector(config, store, **flags)
    assert connector_config.kv_transfer_config is not None
    transfer = attrs.evolve(
        connector_config.kv_transfer_config,
        kv_connector=class_name,
        kv_connector_module_path="tests.support.misbehaving_connectors",
    )
    return attrs.evolve(connector_config, kv_transfer_config=transfer)


def test_a_prompt_longer_than_the_model_allows_is_refused(config: EngineConfig) -> None:
    with (
        LLMEngine(config) as engine,
        pytest.raises(ValueError, match=r"exceeds model_config.max_model_len \(512\)"),
    ):
        engine.add_request(GenerationRequest("long", (1,) * 510, 8))


def test_a_request_larger_than_the_whole_cache_is_refused() -> None:
    with (
        LLMEngine(tiny_config(num_gpu_blocks=4)) as engine,
        pytest.raises(ValueError, match=r"needs 6 blocks but cache_config.num_gpu_blocks is 4"),
    ):
        engine.add_request(GenerationRequest("big", (1,) * 20, 4))


def test_token_ids_outside_the_vocabulary_are_refused(config: EngineConfig) -> None:
    with (
        LLMEngine(config) as engine,
        pytest.raises(ValueError, match=r"token ids \[300\] are outside"),
    ):
        engine.add_request(GenerationRequest("bad", (1, 300), 4))


def test_an_empty_prompt_is_refused(config: EngineConfig) -> None:
    with (
        LLMEngine(config) as engine,
        pytest.raises(ValueError, match=r"request 'e': the prompt is empty"),
    ):
        engine.add_request(GenerationRequest("e", (), 4))


def test_max_tokens_below_one_is_refused(config: EngineConfig) -> None:
    with (
        LLMEngine(config) as engine,
        pytest.raises(ValueError, match=r"request 'z': max_tokens must be >= 1, got 0"),
    ):
        engine.add_request(GenerationRequest("z", (1, 2), 0))


def test_a_reused_request_id_is_refused(config: EngineConfig) -> None:
    with LLMEngine(config) as engine:
        engine.add_request(PROMPT)
        with pytest.raises(ValueError, match=r"request_id 'r' is already in use"):
            engine.add_request(PROMPT)


def test_a_negative_match_count_names_the_connector_and_request(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    bad = _misbehaving(config, tmp_path, "NegativeCountConnector")
    with pytest.raises(
        RuntimeError,
        match=r"NegativeCountConnector.get_num_new_matched_tokens returned -4 for request 'r'",
    ):
        generate(bad, [PROMPT])


def test_an_async_load_of_zero_tokens_is_refused(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    bad = _misbehaving(config, tmp_path, "AsyncZeroConnector")
    with pytest.raises(RuntimeError, match=r"returned \(0, True\) for request 'r'"):
        generate(bad, [PROMPT])


def test_a_load_never_reported_received_ends_in_an_error_not_a_hang(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    generate(with_directory_connector(config, tmp_path), [PROMPT])
    bad = _misbehaving(config, tmp_path, "NeverReceivesConnector", load_async=True)
    with pytest.raises(
        RuntimeError,
        match=(
            r"'r' waits to finish receiving; "
            r"the connector \(NeverReceivesConnector\) never reported"
        ),
    ):
        generate(bad, [attrs.evolve(PROMPT, request_id="r")], idle_timeout_s=0.2)


def test_strict_roles_catch_a_scheduler_side_calling_worker_side_code(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    mixing = _misbehaving(config, tmp_path, "RoleMixingConnector")
    with pytest.raises(
        RoleViolationError,
        match=(
            r"RoleMixingConnector.start_load_kv is a worker-side call, "
            r"but this instance has the SCHEDULER role"
        ),
    ):
        generate(mixing, [PROMPT], connector_hook=Instruments(strict_roles=True))


def test_the_engine_takes_its_connectors_from_the_containers_providers(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    class SubstituteConnector(DirectoryConnector):
        pass

    container = KVConnectorContainer()
    container.engine_config.override(providers.Object(with_directory_connector(config, tmp_path)))
    substitute = providers.Object(SubstituteConnector)
    with (
        container.connector_class.override(substitute),
        LLMEngine(with_directory_connector(config, tmp_path), container=container) as engine,
    ):
        assert type(engine.scheduler_connector) is SubstituteConnector
        assert type(engine.worker_connector) is SubstituteConnector
        assert engine.scheduler_connector is not engine.worker_connector


def test_closing_the_engine_shuts_down_both_connectors_once(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    from kvwire.interface.base import KVConnectorRole
    from kvwire.testing.instruments import CallLog

    log = CallLog()
    engine = LLMEngine(
        with_directory_connector(config, tmp_path), connector_hook=Instruments(log=log)
    )
    engine.generate([PROMPT])
    engine.close()
    engine.close()
    shutdowns = [record.role for record in log.records if record.method == "shutdown"]
    assert sorted(role.name for role in shutdowns) == ["SCHEDULER", "WORKER"]
    # After its shutdown, the worker connector is only asked for its last stats.
    assert log.methods(KVConnectorRole.WORKER)[-2:] == ["shutdown", "get_kv_connector_stats"]
    assert log.methods(KVConnectorRole.SCHEDULER)[-1] == "shutdown"


@pytest.mark.slow
def test_a_worker_process_whose_connector_fails_to_shut_down_still_exits(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    from kvwire.engine.worker_process import WorkerProcessError

    engine = LLMEngine(
        _misbehaving(config, tmp_path, "FailingShutdownConnector"), worker_mode="process"
    )
    engine.generate([PROMPT])
    worker_process = engine._worker_process
    assert worker_process is not None

    with pytest.raises(WorkerProcessError, match="the connector's shutdown broke"):
        engine.close()

    # It returned after reporting the error, rather than waiting for another
    # command until the parent gave up on it and killed it.
    assert worker_process._process.exitcode == 0


@pytest.mark.slow
def test_a_worker_process_that_stops_answering_is_an_error_not_a_hang(
    config: EngineConfig, tmp_path: pathlib.Path
) -> None:
    from kvwire.engine.worker_process import WorkerProcessError

    engine = LLMEngine(
        _misbehaving(config, tmp_path, "HangingSaveConnector"),
        worker_mode="process",
        worker_reply_timeout_s=1.0,
    )
    worker_process = engine._worker_process
    assert worker_process is not None
    started = time.monotonic()

    with pytest.raises(WorkerProcessError, match=r"no reply to 'execute' within 1 s"):
        engine.generate([PROMPT])
    engine.close()

    assert time.monotonic() - started < 30
    assert not worker_process._process.is_alive()


def test_an_engine_without_a_transfer_config_builds_no_connector(config: EngineConfig) -> None:
    with LLMEngine(attrs.evolve(config, kv_transfer_config=None)) as engine:
        assert engine.scheduler_connector is None and engine.worker_connector is None


def test_an_unknown_worker_mode_is_refused(config: EngineConfig) -> None:
    with pytest.raises(ValueError, match=r"worker_mode: 'thread' is not one of inline, process"):
        LLMEngine(config, worker_mode="thread")  # type: ignore[arg-type]


def test_an_unknown_connector_name_fails_with_the_registry_error(config: EngineConfig) -> None:
    unknown = attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(kv_connector="NoSuchConnector", kv_role="kv_both"),
    )
    with pytest.raises(ValueError, match=r"Unsupported connector type: NoSuchConnector"):
        LLMEngine(unknown)


@pytest.mark.parametrize(
    ("module_path", "problem"),
    [
        ("os", "Class CPUOffloadConnector not found in os"),
        ("no.such.mod", "cannot import 'no.such.mod': ModuleNotFoundError"),
    ],
)
def test_an_engine_names_the_module_path_field_it_cannot_load(
    module_path: str, problem: str
) -> None:
    config = attrs.evolve(
        tiny_config(),
        kv_transfer_config=KVTransferConfig(
            kv_connector="CPUOffloadConnector",
            kv_connector_module_path=module_path,
            kv_role="kv_both",
        ),
    )
    with pytest.raises(ModulePathError) as caught:
        LLMEngine(config)
    assert str(caught.value).startswith(f"kv_transfer_config.kv_connector_module_path: {problem}")
