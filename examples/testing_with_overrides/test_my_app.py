"""How a user tests code wired to a KVConnectorContainer: by overriding its providers.

Every override below is dependency-injector's own ``override``, used as a
context manager: the part is swapped inside the ``with`` block and restored
when it ends. Nothing is monkeypatched.

Run: ``.venv/bin/pytest examples/testing_with_overrides``
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest
from dependency_injector import providers
from my_app import build_container, hybrid_kv_cache_enabled, tokens_to_load

from kvwire import (
    EngineConfig,
    HMADecision,
    KVCacheConfig,
    KVConnectorContainer,
    KVConnectorRole,
    Request,
    build_full_attention_kv_cache_config,
)
from kvwire.testing import IdleConnector


class EverythingCachedConnector(IdleConnector):
    """A test double: claims every full block of every prompt is loadable.

    ``IdleConnector`` answers every other call the way a connector with nothing
    to do answers it, so the double shows only the behaviour under test.
    """

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        block_size = self.engine_config.cache_config.block_size
        cached = request.num_prompt_tokens // block_size * block_size
        return max(cached - num_computed_tokens, 0), False


def cache_config(num_blocks: int) -> KVCacheConfig:
    return build_full_attention_kv_cache_config(
        num_layers=2,
        num_blocks=num_blocks,
        block_size=16,
        num_kv_heads=2,
        head_size=16,
        dtype="float32",
    )


@pytest.fixture
def container() -> Iterator[KVConnectorContainer]:
    built = build_container(cache_config(num_blocks=64))
    yield built
    built.shutdown_resources()
    built.unwire()


def a_request(prompt_tokens: int) -> Request:
    return Request(request_id="r", prompt_token_ids=list(range(prompt_tokens)), max_tokens=4)


def test_the_profile_builds_the_cpu_offload_connector(container: KVConnectorContainer) -> None:
    assert container.connector_class().__name__ == "CPUOffloadConnector"
    # A cold CPU pool has nothing to load.
    assert tokens_to_load(a_request(40)) == 0


def test_a_test_double_replaces_the_connector_class_inside_the_block(
    container: KVConnectorContainer,
) -> None:
    with container.connector_class.override(providers.Object(EverythingCachedConnector)):
        assert tokens_to_load(a_request(40)) == 32

    assert container.connector_class().__name__ == "CPUOffloadConnector"


def test_a_connector_instance_can_be_injected_directly(container: KVConnectorContainer) -> None:
    engine_config = container.engine_config()
    double = EverythingCachedConnector(engine_config, KVConnectorRole.SCHEDULER, cache_config(8))

    with container.scheduler_connector.override(providers.Object(double)):
        assert tokens_to_load(a_request(20)) == 16


def test_the_sized_cache_is_swapped_inside_the_block(container: KVConnectorContainer) -> None:
    with container.kv_cache_config.override(providers.Object(cache_config(num_blocks=8))):
        assert container.kv_cache_config().num_blocks == 8

    assert container.kv_cache_config().num_blocks == 64


def test_the_hma_gate_is_forced_inside_the_block(container: KVConnectorContainer) -> None:
    # CPU offload serves hybrid models, so the gate left unset keeps HMA on.
    assert hybrid_kv_cache_enabled()

    with container.hma_gate.override(providers.Object(HMADecision(False, "forced by a test"))):
        assert not hybrid_kv_cache_enabled()

    assert hybrid_kv_cache_enabled()


def test_another_engine_config_is_used_inside_the_block(container: KVConnectorContainer) -> None:
    original: EngineConfig = container.engine_config()
    larger_blocks = attrs.evolve(
        original, cache_config=attrs.evolve(original.cache_config, block_size=32)
    )

    with container.engine_config.override(providers.Object(larger_blocks)):
        assert container.connector_engine_config().cache_config.block_size == 32

    assert container.connector_engine_config().cache_config.block_size == 16


def test_several_providers_are_swapped_at_once(container: KVConnectorContainer) -> None:
    with container.override_providers(
        connector_class=providers.Object(EverythingCachedConnector),
        kv_cache_config=providers.Object(cache_config(num_blocks=8)),
    ):
        connector = container.scheduler_connector()
        assert isinstance(connector, EverythingCachedConnector)
        assert connector.kv_cache_config.num_blocks == 8
