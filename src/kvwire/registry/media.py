"""The registry of media: one lazy provider per medium name, beside the connectors'.

A medium (`kvwire.media.Medium`) is where an offload connector keeps
blocks. Like connectors, media are named through the same mechanism
(`PluginNames`), and a name is imported only when a connector asks for it: the
media kvwire ships, the `kvwire.media` entry-point group of installed
distributions (`name = package.module:Class`) and
`MediumRegistry.register_medium` at run time. A profile may also name a class
directly, as `package.module:Class`.

Every `kvwire.ConnectorRegistry` holds one
(`registry.media`), and a container's connectors resolve their medium
through it: overriding a medium's provider swaps it for every connector
built through that registry, as overriding a connector's provider does:

```python
registry = default_registry().copy()
with registry.media.provider("directory").override(providers.Object(FaultyDirectory)):
    ...  # containers given `registry` build their connectors over FaultyDirectory
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvwire.common.extras import missing_extra
from kvwire.common.redaction import shown
from kvwire.exceptions import KVWireError
from kvwire.exceptions import UnknownMediumError as UnknownMediumError
from kvwire.registry.plugin_classes import PluginClassRegistry

if TYPE_CHECKING:
    from kvwire.media.base import Medium  # noqa: F401 - the quoted base class names it

MEDIA_ENTRY_POINT_GROUP = "kvwire.media"

BUILT_IN_MEDIA: dict[str, tuple[str, str]] = {
    "cpu_pool": ("kvwire.media.cpu_pool.medium", "CPUPoolMedium"),
    "directory": ("kvwire.media.store.directory.medium", "DirectoryMedium"),
    "peer": ("kvwire.media.peer.medium", "PeerMedium"),
    "redis": ("kvwire.media.store.redis.medium", "RedisMedium"),
    "tiered": ("kvwire.media.tiered.medium", "TieredMedium"),
}
"""The media kvwire ships: name -> (module path, class name)."""


class MediumRegistry(PluginClassRegistry["Medium"]):
    """Medium names mapped to lazy class providers (`providers`, one per name)."""

    kind = "medium"
    base = "kvwire.media.base:Medium"
    error = UnknownMediumError
    shipped = BUILT_IN_MEDIA
    entry_point_group = MEDIA_ENTRY_POINT_GROUP
    form_detail = " (a dotted module path of identifiers, then one class name)"
    abstract_advice = (
        "; expected a medium class that can be built, such as a subclass implementing them"
    )
    listing_hint = " (kvwire connectors lists every medium)"

    def register_medium(self, name: str, module_path: str, class_name: str) -> None:
        """Register `name` lazily: `module_path` is imported only once a connector needs it."""
        self._register("register_medium", name, module_path, class_name)

    def _import_failure(self, error: Exception, what: str) -> KVWireError:
        missing = missing_extra(error, f"medium {shown(what)}")
        if missing is not None:
            # A ValueError still (a profile names the medium), whose words say the fix.
            return UnknownMediumError(str(missing))
        return super()._import_failure(error, what)
