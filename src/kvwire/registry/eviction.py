"""The registry of eviction policies: one lazy provider per policy name, as media have.

An eviction policy (`kvwire.media.eviction.EvictionPolicy`)
decides which entry a full CPU pool gives up; the pool's `eviction` option
names it. Names come from the same three places as media's: the policies
kvwire ships (`lru`, `s3fifo`, `arc`, `kvfifo`), the `kvwire.eviction_policies` entry-point
group of installed distributions (`name = package.module:Class`) and
`EvictionPolicyRegistry.register_policy` at run time; a `package.module:Class`
names a class directly. Every `kvwire.ConnectorRegistry`
holds one (`registry.eviction_policies`); the container resolves a pool's
option through its own registry's and hands the pool the class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvwire.exceptions import UnknownEvictionPolicyError as UnknownEvictionPolicyError
from kvwire.registry.plugin_classes import PluginClassRegistry

if TYPE_CHECKING:
    from kvwire.media.eviction import EvictionPolicy  # noqa: F401 - the quoted base class names it

EVICTION_POLICIES_ENTRY_POINT_GROUP = "kvwire.eviction_policies"

BUILT_IN_EVICTION_POLICIES: dict[str, tuple[str, str]] = {
    "lru": ("kvwire.media.eviction", "LRUPolicy"),
    "s3fifo": ("kvwire.media.eviction", "S3FIFOPolicy"),
    "arc": ("kvwire.media.eviction", "ARCPolicy"),
    "kvfifo": ("kvwire.media.eviction", "KVFIFOPolicy"),
}
"""The eviction policies kvwire ships: name -> (module path, class name)."""


class EvictionPolicyRegistry(PluginClassRegistry["EvictionPolicy"]):
    """Eviction policy names mapped to lazy class providers (`providers`, one per name)."""

    kind = "eviction policy"
    base = "kvwire.media.eviction:EvictionPolicy"
    error = UnknownEvictionPolicyError
    shipped = BUILT_IN_EVICTION_POLICIES
    entry_point_group = EVICTION_POLICIES_ENTRY_POINT_GROUP

    def register_policy(self, name: str, module_path: str, class_name: str) -> None:
        """Register `name` lazily: `module_path` is imported only once a pool needs it."""
        self._register("register_policy", name, module_path, class_name)
