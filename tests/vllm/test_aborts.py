"""A request vLLM finishes while kvwire still loads into its blocks, in a real vLLM engine.

vLLM aborts a request whenever its client goes away; one waiting for an
asynchronous load (``WAITING_FOR_REMOTE_KVS``) keeps its blocks until the
load is reported done. KVWireConnector must then let the engine free them,
keep no state for the request, and go on serving later requests.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvwire.vllm import wait_for_saves
from tests.support.vllm import (
    BLOCK_SIZE,
    MAX_TOKENS,
    READS_ANSWER,
    generate,
    kvwire_transfer_config,
    profile_with_directory,
    running_llm,
    shared_prompts,
    start_llm,
    stop_llm,
)

PROMPTS = shared_prompts()
LOADABLE_TOKENS = (300 - 1) // BLOCK_SIZE * BLOCK_SIZE
STEP_LIMIT_S = 60.0


def step_until(engine: Any, done: Callable[[], bool]) -> None:
    """Step ``engine`` until ``done()``; fail past :data:`STEP_LIMIT_S`."""
    deadline = time.monotonic() + STEP_LIMIT_S
    while not done():
        assert time.monotonic() < deadline, f"not done after {STEP_LIMIT_S} s of steps"
        engine.step()


def async_load_profile(directory: pathlib.Path) -> dict[str, Any]:
    profile = profile_with_directory("shared-storage.yaml", directory)
    profile["kv_transfer_config"]["kv_connector_extra_config"]["async_load"] = True
    return profile


@pytest.mark.slow
def test_request_aborted_while_its_load_is_in_flight_is_forgotten_and_the_engine_goes_on(
    tiny_model: str, tokens_without_connector: list[list[int]], tmp_path: pathlib.Path
) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    config = kvwire_transfer_config(
        async_load_profile(tmp_path), kvwire_container_hook="tests.support.vllm:held_reads"
    )
    with running_llm(tiny_model, config) as llm:
        generate(llm, PROMPTS)
        wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        connector = scheduler.connector
        READS_ANSWER.clear()
        try:
            engine.add_request("aborted", PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS))
            step_until(
                engine,
                lambda: any(
                    request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                    for request in scheduler.requests.values()
                ),
            )
            engine.abort_request(["aborted"])
        finally:
            READS_ANSWER.set()
        step_until(engine, lambda: not scheduler.has_requests())
        assert not connector.has_pending_push_work()
        half = connector._scheduler
        assert (half._live, len(half._block_tables)) == ({}, 0)
        tokens, cached = generate(llm, PROMPTS)
    assert tokens == tokens_without_connector
    assert cached == [LOADABLE_TOKENS] * len(PROMPTS)


@pytest.mark.slow
def test_engine_shut_down_while_a_load_is_in_flight_stops_by_the_load_deadline(
    tiny_model: str, tmp_path: pathlib.Path
) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    profile = async_load_profile(tmp_path)
    profile["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout_s"] = 1
    config = kvwire_transfer_config(profile, kvwire_container_hook="tests.support.vllm:held_reads")
    llm = start_llm(tiny_model, config)
    stopped_after_s = None
    try:
        generate(llm, PROMPTS)
        wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        READS_ANSWER.clear()
        llm.llm_engine.add_request("held", PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS))
        step_until(
            llm.llm_engine,
            lambda: any(
                request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                for request in scheduler.requests.values()
            ),
        )
        started = time.monotonic()
        stop_llm(llm)
        stopped_after_s = time.monotonic() - started
    finally:
        READS_ANSWER.set()
        if stopped_after_s is None:
            stop_llm(llm)
    # The load's deadline is 1 s; the read itself stays held until READS_ANSWER.
    assert stopped_after_s < 10
