"""Every error kvwire raises on its own account, in one place.

The errors kept from vLLM (an unknown connector name, a deprecated
constructor, HMA enabled for a connector that cannot serve it) stay plain
`ValueError`/`AttributeError` with vLLM's exact texts, so code
written against it keeps catching them. Every other exception class kvwire
defines, here or in the module that raises it (`CorruptBlockError`,
`ExtraConfigError`, ...), derives from [`KVWireError`][kvwire.KVWireError] and from the
builtin a caller would naturally catch, so `except KVWireError` catches
whatever kvwire raises on its own account.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

# How many of a profile's problems its error message lists.
MAX_LISTED_PROBLEMS = 50


class KVWireError(Exception):
    """Base of the errors kvwire defines."""


class ProfileError(KVWireError, ValueError):
    """A profile (YAML file or mapping) that does not describe a valid `EngineConfig`.

    `problems` lists every problem found, each starting with the dotted path
    of the field at fault (`kv_transfer_config.kv_role: ...`); `origin`
    names the file, or `<mapping>` for a profile given as a dict. Both are
    read-only.
    """

    def __init__(self, origin: str, problems: Sequence[str]) -> None:
        self.origin = origin
        self.problems: tuple[str, ...] = tuple(problems)
        count = len(self.problems)
        heading = f"invalid profile {origin} ({count} problem{'s' if count != 1 else ''}):"
        # The message stays readable, and bounded, however many there are.
        listed = list(self.problems[:MAX_LISTED_PROBLEMS])
        if count > MAX_LISTED_PROBLEMS:
            listed.append(f"... and {count - MAX_LISTED_PROBLEMS} more (see .problems)")
        super().__init__("\n  ".join([heading, *listed]))


class ConnectorImportError(KVWireError, ImportError):
    """A registered connector (built in or registered at run time) whose class cannot be loaded."""


class ConnectorEntryPointError(KVWireError, ImportError):
    """An entry point of the `kvwire.connectors` group that is malformed or cannot be loaded.

    The message names the distribution that declares it and the entry point
    itself (`Name = package.module:Class`).
    """


class MissingExtraError(KVWireError, ModuleNotFoundError):
    """An optional dependency kvwire needs here is not installed; the message says what to install.

    `name` is the missing module (`torch`), `extra` the extra of kvwire that
    provides it (`pip install 'kvwire[torch]'`), `needed_by` what imported
    it (`kvwire run`, `medium 'redis'`). All three are read-only.
    """

    def __init__(self, needed_by: str, module: str, extra: str) -> None:
        super().__init__(
            f"{needed_by} needs {module}, which is not installed: pip install 'kvwire[{extra}]'",
            name=module,
        )
        self.needed_by = needed_by
        self.extra = extra


class NotAConnectorError(KVWireError, TypeError):
    """A name that resolves to something other than a `KVConnectorBase` subclass."""


class ContainerSetupError(KVWireError, RuntimeError):
    """A `KVConnectorContainer` asked for a connector before it was told what it needs.

    For example the process's role was never declared, or `kv_cache_config`
    was never provided.
    """


class ConnectorBuildTimeout(ContainerSetupError, TimeoutError):
    """A connector's constructor, running in another thread, outlasted the wait for it."""


class ModulePathError(ConnectorImportError):
    """A `kv_connector_module_path` that cannot be imported, or lacks the class named.

    The message starts with the field's dotted path in the profile
    ([`ConnectorRegistry.check_module_path`][kvwire.ConnectorRegistry.check_module_path]).
    """


class UnknownMediumError(KVWireError, ValueError):
    """A medium name that is not registered, or a `module:Class` that is not a medium."""


class JobAbandoned(KVWireError):
    """Raised inside a job whose caller gave up on it: it must write nothing more."""


class WorkerProcessError(KVWireError, RuntimeError):
    """The worker process failed; the message carries its traceback."""


def kind_of(value: object) -> str:
    """How an error names a value it must not echo, a possible secret: by its type alone.

    `"a str"`, `"an int"`, `"None"`.
    """
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class ConnectorRoleError(KVWireError, RuntimeError):
    """A call of one role made on a connector built for the other role.

    A connector split by role builds only the half its role serves, so a
    worker-side call on a scheduler-role connector (or the reverse) finds no
    state to act on; the message names the call and both roles.
    """


class VLLMConfigError(KVWireError, ValueError):
    """vLLM's configuration asks for something kvwire cannot serve; the message says what.

    Defined here rather than in [`kvwire.vllm`][kvwire.vllm], so that code without vLLM
    installed can name it.
    """


# The errors defined beside the code that raises them, reachable from here too:
# `from kvwire.exceptions import CorruptBlockError`. They load on first use,
# so importing this module imports neither torch nor redis nor any medium.
_DEFINED_ELSEWHERE = {
    "CorruptBlockError": "kvwire.blocks.format",
    "DeadlineExceeded": "kvwire.media.store.redis._wire",
    "ExtraConfigError": "kvwire.config.extra_config",
    "FileChangedError": "kvwire._file_digests",
    "FileRefused": "kvwire.config.bounded_file",
    "LateWriteError": "kvwire.media.store.base",
    "MacKeyError": "kvwire.blocks.mac",
    "ModelIdentityError": "kvwire.model_identity",
    "NIXLUnavailableError": "kvwire.media.peer._agent",
    "PluginExit": "kvwire.plugin_calls",
    "ProfileYAMLError": "kvwire.config.profile_yaml",
    "RedisSettingsError": "kvwire.media.store.redis._settings",
    "RoleViolationError": "kvwire.testing.instruments",
    "StoreReplyError": "kvwire.media.store.base",
    "UnreadableWeightsError": "kvwire.model_identity",
    "ValueRefused": "kvwire.config.extra_config",
}

if TYPE_CHECKING:
    from kvwire._file_digests import FileChangedError
    from kvwire.blocks.format import CorruptBlockError
    from kvwire.blocks.mac import MacKeyError
    from kvwire.config.bounded_file import FileRefused
    from kvwire.config.extra_config import ExtraConfigError, ValueRefused
    from kvwire.config.profile_yaml import ProfileYAMLError
    from kvwire.media.peer._agent import NIXLUnavailableError
    from kvwire.media.store.base import LateWriteError, StoreReplyError
    from kvwire.media.store.redis._settings import RedisSettingsError
    from kvwire.media.store.redis._wire import DeadlineExceeded
    from kvwire.model_identity import ModelIdentityError, UnreadableWeightsError
    from kvwire.plugin_calls import PluginExit
    from kvwire.testing.instruments import RoleViolationError

__all__ = [
    "ConnectorBuildTimeout",
    "ConnectorEntryPointError",
    "ConnectorImportError",
    "ConnectorRoleError",
    "ContainerSetupError",
    "CorruptBlockError",
    "DeadlineExceeded",
    "ExtraConfigError",
    "FileChangedError",
    "FileRefused",
    "JobAbandoned",
    "KVWireError",
    "LateWriteError",
    "MacKeyError",
    "MissingExtraError",
    "ModelIdentityError",
    "ModulePathError",
    "NIXLUnavailableError",
    "NotAConnectorError",
    "PluginExit",
    "ProfileError",
    "ProfileYAMLError",
    "RedisSettingsError",
    "RoleViolationError",
    "StoreReplyError",
    "UnknownMediumError",
    "UnreadableWeightsError",
    "VLLMConfigError",
    "ValueRefused",
    "WorkerProcessError",
]


def __getattr__(name: str) -> type[KVWireError]:
    if name not in _DEFINED_ELSEWHERE:
        raise AttributeError(f"module 'kvwire.exceptions' has no attribute {name!r}")
    import importlib

    error: type[KVWireError] = getattr(importlib.import_module(_DEFINED_ELSEWHERE[name]), name)
    return error
