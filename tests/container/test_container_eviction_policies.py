"""The CPU pool's eviction policy, resolved through the registry of the container that builds it.

The pool's `eviction` option names a plug-in class: the container resolves
it through its own registry (`medium_plugins`) and hands the class to the
medium in its context, so a policy registered or overridden on a
container's registry copy is the one its pools use, and the process-wide
registry never sees it. `kvwire check` resolves it through the registry it
checks with.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
from dependency_injector import providers

from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.multi import MultiConnector
from kvwire.connectors.offload import CPUOffloadConnector
from kvwire.container import container_for_profile
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.eviction import EvictionPolicy, KVFIFOPolicy, LRUPolicy, S3FIFOPolicy
from kvwire.registry import ConnectorRegistry, default_registry
from tests.support.pairs import cache_config_for, engine_config

REPO = pathlib.Path(__file__).resolve().parents[2]
POOL = {"cpu_pool_bytes": "1MiB"}

# The offload connectors and their media need the torch extra.
pytestmark = pytest.mark.torch


class FIFOPolicy(LRUPolicy):
    """First in, first out: a hit does not refresh a block."""

    def hit(self, slot: int) -> None:
        pass


def _container(connector: str, extra: dict[str, Any], registry: ConnectorRegistry) -> Any:
    config = engine_config(connector, extra)
    return container_for_profile(
        config, kv_cache_config=cache_config_for(config), registry=registry
    )


def _pool_policy(connector: CPUOffloadConnector) -> EvictionPolicy:
    index = connector._scheduler_half("the pool's policy").index
    assert isinstance(index, CPUPoolIndex)
    policy: EvictionPolicy = index._index._policy
    return policy


def test_a_policy_registered_on_the_container_s_registry_copy_reaches_the_pool() -> None:
    registry = default_registry().copy()
    registry.eviction_policies.register_policy("fifo", __name__, "FIFOPolicy")
    container = _container("CPUOffloadConnector", {**POOL, "eviction": "fifo"}, registry)

    assert container.medium_plugins() == {"eviction": FIFOPolicy}
    assert type(_pool_policy(container.scheduler_connector())) is FIFOPolicy
    assert "fifo" not in default_registry().eviction_policies.names()
    container.shutdown_resources()


def test_the_process_wide_registry_refuses_a_name_registered_on_a_copy_only() -> None:
    copied = default_registry().copy()
    copied.eviction_policies.register_policy("fifo", __name__, "FIFOPolicy")
    container = _container("CPUOffloadConnector", {**POOL, "eviction": "fifo"}, copied)
    refused = pytest.raises(
        ExtraConfigError,
        match=r"kv_connector_extra_config\.eviction: unknown eviction policy 'fifo'",
    )
    with container.registry.override(providers.Object(default_registry())), refused:
        container.scheduler_connector()


def test_a_policy_overridden_on_the_registry_copy_is_the_one_the_pool_uses() -> None:
    registry = default_registry().copy()
    registry.eviction_policies.provider("kvfifo").override(providers.Object(FIFOPolicy))
    container = _container("CPUOffloadConnector", POOL, registry)

    assert type(_pool_policy(container.scheduler_connector())) is FIFOPolicy
    assert default_registry().eviction_policies.get_class("kvfifo") is KVFIFOPolicy
    container.shutdown_resources()


def test_a_composite_s_child_pool_takes_its_policy_from_the_same_registry() -> None:
    registry = default_registry().copy()
    registry.eviction_policies.register_policy("fifo", __name__, "FIFOPolicy")
    child = {
        "kv_connector": "CPUOffloadConnector",
        "kv_connector_extra_config": {**POOL, "eviction": "fifo"},
    }
    container = _container("MultiConnector", {"connectors": [child]}, registry)

    multi = container.scheduler_connector()

    assert isinstance(multi, MultiConnector)
    assert type(_pool_policy(multi.children[0])) is FIFOPolicy
    container.shutdown_resources()


def test_the_check_resolves_the_policy_through_the_registry_it_checks_with() -> None:
    config = engine_config("CPUOffloadConnector", {**POOL, "eviction": "fifo"})
    transfer = config.kv_transfer_config
    assert transfer is not None
    copied = default_registry().copy()
    copied.eviction_policies.register_policy("fifo", __name__, "FIFOPolicy")

    CPUOffloadConnector.validate_extra_config(transfer, copied)
    with pytest.raises(
        ExtraConfigError,
        match=r"^kv_connector_extra_config\.eviction: unknown eviction policy 'fifo'; expected "
        r"one of lru, s3fifo, arc, kvfifo, or a class as 'package\.module:Class'; did you mean "
        r"'s3fifo'\?$",
    ):
        CPUOffloadConnector.validate_extra_config(transfer, ConnectorRegistry())


def test_an_overridden_policy_is_the_one_the_check_loads() -> None:
    config = engine_config("CPUOffloadConnector", {**POOL, "eviction": "s3fifo"})
    transfer = config.kv_transfer_config
    assert transfer is not None
    copied = default_registry().copy()
    # A provider that yields no policy class: the check asks the copy, not the default.
    copied.eviction_policies.provider("s3fifo").override(providers.Object(dict))

    CPUOffloadConnector.validate_extra_config(transfer, default_registry())
    with pytest.raises(
        ExtraConfigError,
        match=r"kv_connector_extra_config\.eviction: eviction policy 's3fifo' is <class 'dict'>, "
        r"not a class deriving from",
    ):
        CPUOffloadConnector.validate_extra_config(transfer, copied)
    assert default_registry().eviction_policies.get_class("s3fifo") is S3FIFOPolicy


def test_the_docs_registry_copy_example_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REPO / "docs" / "container.md").read_text()
    blocks = [
        block
        for block in re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
        if "register_policy" in block
    ]
    assert len(blocks) == 1
    monkeypatch.chdir(REPO)
    namespace: dict[str, object] = {}

    exec(compile(blocks[0], "docs/container.md eviction policy example", "exec"), namespace)

    assert "scan_resistant" not in default_registry().eviction_policies.names()
