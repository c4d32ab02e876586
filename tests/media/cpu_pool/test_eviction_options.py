"""The CPU pool's `eviction` and `save_threshold` options, and the registry of eviction policies."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.config.extra_config import ExtraConfigError, plugin_classes, read_extra_config
from kvwire.exceptions import UnknownEvictionPolicyError
from kvwire.media.admission import SaveAdmission
from kvwire.media.base import MediumContext
from kvwire.media.cpu_pool import CPUPoolMedium
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.eviction import (
    ARCPolicy,
    EvictionPolicy,
    KVFIFOPolicy,
    LRUPolicy,
    S3FIFOPolicy,
)
from kvwire.registry import ConnectorRegistry, EvictionPolicyRegistry, default_registry

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")


class FIFOPolicy(LRUPolicy):
    """First in, first out: a policy of one's own, named by `module:Class`."""

    def hit(self, slot: int) -> None:
        pass


class NotAPolicy:
    pass


def built_index(**extra: Any) -> CPUPoolIndex:
    """The pool's index, its options read and its plug-ins resolved as the container does."""
    keys = CPUPoolMedium.extra_config_keys()
    options = read_extra_config(
        "TestConnector", {"cpu_pool_bytes": 16 * LAYOUT.entry_bytes, **extra}, keys
    )
    plugins = plugin_classes(keys, options, ConnectorRegistry(entry_point_group=None))
    group = CacheGroup(0, ("layers.0", "layers.1"), LAYOUT.block_size)
    context = MediumContext("TestConnector", options, (group,), LAYOUT, plugins=plugins)
    index = CPUPoolMedium(context).build_index()
    assert isinstance(index, CPUPoolIndex)
    return index


def policy_of(index: CPUPoolIndex) -> EvictionPolicy:
    policy: EvictionPolicy = index._index._policy
    return policy


def test_the_pool_evicts_with_kvfifo_and_saves_every_block_by_default() -> None:
    index = built_index()
    assert type(policy_of(index)) is KVFIFOPolicy
    assert index._admission is None


@pytest.mark.parametrize(
    ("spec", "policy_class"),
    [
        ("lru", LRUPolicy),
        ("s3fifo", S3FIFOPolicy),
        ("arc", ARCPolicy),
        ("kvfifo", KVFIFOPolicy),
        (f"{__name__}:FIFOPolicy", FIFOPolicy),
    ],
)
def test_eviction_names_the_pool_s_policy(spec: str, policy_class: type) -> None:
    policy = policy_of(built_index(eviction=spec))
    assert type(policy) is policy_class
    assert policy.capacity == 16


def test_save_threshold_builds_a_sketch_sized_from_the_pool() -> None:
    admission = built_index(save_threshold=2)._admission
    assert isinstance(admission, SaveAdmission)
    assert admission.threshold == 2
    assert admission.width == 1024  # the least: 16 slots want 128 counters


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "lfu",
            r"unknown eviction policy 'lfu'; expected one of lru, s3fifo, arc, kvfifo, or a class",
        ),
        ("LRU", r"did you mean 'lru'\?"),
        (3, r"3 is not accepted by TestConnector; expected an eviction policy's name"),
        ("", r"'' is not accepted"),
        (f"{__name__}:NotAPolicy", r"not a class deriving from kvwire.media.eviction"),
        ("kvwire.media.eviction:EvictionPolicy", r"is abstract"),
        ("no_such_module_kvwire:Policy", r"cannot be loaded: ModuleNotFoundError"),
        ("../x:Policy", r"not of the form 'package.module:Class'"),
    ],
)
def test_a_bad_eviction_is_refused_naming_the_key(value: object, message: str) -> None:
    with pytest.raises(
        ExtraConfigError, match=r"kv_connector_extra_config\.eviction: .*" + message
    ):
        built_index(eviction=value)


@pytest.mark.parametrize("value", [0, 65, True, "2", 1.5, None])
def test_a_bad_save_threshold_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(
        ExtraConfigError,
        match=r"kv_connector_extra_config\.save_threshold: .* expected an integer between 1 and 64",
    ):
        built_index(save_threshold=value)


def test_a_context_built_without_the_policy_class_says_how_to_pass_it() -> None:
    options = read_extra_config(
        "TestConnector", {"eviction": "s3fifo"}, CPUPoolMedium.extra_config_keys()
    )
    group = CacheGroup(0, ("layers.0", "layers.1"), LAYOUT.block_size)
    medium = CPUPoolMedium(MediumContext("TestConnector", options, (group,), LAYOUT))
    with pytest.raises(ValueError, match=r"MediumContext\.plugins has no 'eviction' class"):
        medium.build_index()


def test_a_context_built_by_hand_for_the_default_policy_needs_no_registry() -> None:
    options = read_extra_config("TestConnector", {}, CPUPoolMedium.extra_config_keys())
    group = CacheGroup(0, ("layers.0", "layers.1"), LAYOUT.block_size)
    medium = CPUPoolMedium(MediumContext("TestConnector", options, (group,), LAYOUT))
    index = medium.build_index()
    assert isinstance(index._index._policy, KVFIFOPolicy)  # type: ignore[attr-defined]


def test_a_registry_without_eviction_policies_is_refused_naming_the_key() -> None:
    options = read_extra_config("TestConnector", {}, CPUPoolMedium.extra_config_keys())
    with pytest.raises(
        ExtraConfigError,
        match=r"kv_connector_extra_config\.eviction: the registry has no eviction_policies",
    ):
        plugin_classes(CPUPoolMedium.extra_config_keys(), options, object())


def test_every_connector_registry_holds_the_built_in_policies() -> None:
    registry = ConnectorRegistry(entry_point_group=None)
    assert registry.eviction_policies.names() == ["lru", "s3fifo", "arc", "kvfifo"]
    assert registry.eviction_policies.get_class("s3fifo") is S3FIFOPolicy


def test_a_policy_registered_at_run_time_reaches_the_registry_copies_only() -> None:
    copied = default_registry().copy()
    copied.eviction_policies.register_policy("fifo", __name__, "FIFOPolicy")
    assert copied.eviction_policies.get_class("fifo") is FIFOPolicy
    assert copied.copy().eviction_policies.get_class("fifo") is FIFOPolicy
    assert "fifo" not in default_registry().eviction_policies.names()


def test_a_policy_s_provider_can_be_overridden() -> None:
    from dependency_injector import providers

    registry = EvictionPolicyRegistry(entry_point_group=None)
    with registry.provider("lru").override(providers.Object(FIFOPolicy)):
        assert registry.get_class("lru") is FIFOPolicy
    assert registry.get_class("lru") is LRUPolicy


@pytest.mark.parametrize(
    ("name", "module_path", "class_name", "message"),
    [
        ("no-dash", "pkg.mod", "Cls", "name must be an identifier"),
        ("ok", "../pkg", "Cls", "module_path must be a dotted module name"),
        ("ok", "pkg.mod", "1Cls", "class_name must be a Python identifier"),
    ],
)
def test_a_malformed_registration_is_refused(
    name: str, module_path: str, class_name: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EvictionPolicyRegistry(entry_point_group=None).register_policy(
            name, module_path, class_name
        )


def test_an_unknown_name_is_its_own_error() -> None:
    with pytest.raises(UnknownEvictionPolicyError, match="unknown eviction policy 'lfu'"):
        EvictionPolicyRegistry(entry_point_group=None).get_class("lfu")


class _InstalledPolicies:
    """``importlib.metadata`` as seen with a distribution naming a policy in the group."""

    @staticmethod
    def entry_points(group: str) -> list[metadata.EntryPoint]:
        assert group == "kvwire.eviction_policies"
        return [metadata.EntryPoint("fifo", f"{__name__}:FIFOPolicy", group)]


def test_an_installed_distribution_names_a_policy_through_its_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvwire.registry.names.metadata", _InstalledPolicies)
    registry = EvictionPolicyRegistry()
    assert registry.names() == ["lru", "s3fifo", "arc", "kvfifo", "fifo"]
    assert registry.get_class("fifo") is FIFOPolicy
