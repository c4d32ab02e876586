"""Every error kvwire raises on its own account, in one place.

The errors kept from vLLM (an unknown connector name, a deprecated
constructor, HMA enabled for a connector that cannot serve it) stay plain
`ValueError`/`AttributeError` with vLLM's exact texts, so code
written against it keeps catching them. Every other exception class kvwire
makes public is defined here, derives from `kvwire.KVWireError` and from
the builtin a caller would naturally catch, so `except KVWireError` catches
whatever kvwire raises on its own account. The modules that raise them import
them from here, and this module imports nothing of kvwire and no optional
dependency: naming an error costs no torch, redis or medium import.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    (`kvwire.ConnectorRegistry.check_module_path`).
    """


class UnknownMediumError(KVWireError, ValueError):
    """A medium name that is not registered, or a `module:Class` that is not a medium."""


class UnknownEvictionPolicyError(KVWireError, ValueError):
    """An eviction policy name that is not registered, or a `module:Class` that is no policy."""


class JobAbandoned(KVWireError):
    """Raised inside a job whose caller gave up on it: it must write nothing more."""


class ConnectorRoleError(KVWireError, RuntimeError):
    """A call of one role made on a connector built for the other role.

    A connector split by role builds only the half its role serves, so a
    worker-side call on a scheduler-role connector (or the reverse) finds no
    state to act on; the message names the call and both roles.
    """


class VLLMConfigError(KVWireError, ValueError):
    """vLLM's configuration asks for something kvwire cannot serve; the message says what.

    Defined here rather than in `kvwire.vllm`, so that code without vLLM
    installed can name it.
    """


class ProfileYAMLError(KVWireError, ValueError):
    """A profile's text that is not valid YAML, or that this loader refuses; no source quoted."""


class FileRefused(KVWireError, ValueError):
    """A path that names no regular file, or a file over its bound; the message says which."""


class FileChangedError(KVWireError, OSError):
    """The file changed while it was being read, or since the stamp it had to have.

    Its digest names no one version of it, or not the one that was used.
    """


class ExtraConfigError(KVWireError, ValueError):
    """A `kv_connector_extra_config` value or key that a connector does not accept."""


class ValueRefused(KVWireError):
    """Raised by an `kvwire.media.ExtraConfigKey`'s `convert` to refuse a value
    with its own reason.

    The reason replaces the key's generic "expected ..." text, for a value
    of the right form that still cannot work (more memory than the machine has).
    """


class ModelIdentityError(KVWireError, ValueError):
    """A model kvwire cannot identify by its weights; the message says how to name it."""


class UnreadableWeightsError(ModelIdentityError):
    """A file at the model's path that kvwire cannot read whole: no identity can be sure."""


class MacKeyError(KVWireError, ValueError):
    """The MAC key's environment variable is badly named, unset, empty or too short."""


class RedisSettingsError(KVWireError, ValueError):
    """Bad Redis settings; the message names every key at fault and what is accepted."""


class PluginExit(KVWireError, RuntimeError):
    """Plug-in code that raised `SystemExit`, `KeyboardInterrupt` or `GeneratorExit` itself.

    Those would end the process (or escape every `except Exception`) with
    a traceback; raised by a module at import or by a hook, they are the
    plug-in's failure, so `contained_exits` turns them into this
    ordinary error. `original` is what the plug-in raised (read-only).
    """

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


class WorkerProcessError(KVWireError, RuntimeError):
    """The worker process failed; the message carries its traceback."""


class RoleViolationError(KVWireError, RuntimeError):
    """A connector instance was asked (or asked itself) a question of the other role."""


class CorruptBlockError(KVWireError, ValueError):
    """A stored entry that must not be loaded; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StoreReplyError(KVWireError, ValueError):
    """A store's answer that is not one result per key it was given (a short `put` reply).

    Which keys the answer is about cannot be told, so none of them counts as
    stored.
    """


class LateWriteError(KVWireError, RuntimeError):
    """A load given up on is still writing into the KV cache after the grace period.

    A syscall in flight cannot be cancelled; continuing would let it write
    into blocks the engine has taken back, so the engine must stop instead.
    """


class DeadlineExceeded(KVWireError, TimeoutError):
    """A call to the server ran past its overall deadline (its connection is mid-reply).

    A builtin `TimeoutError`, hence an `OSError`: kvwire's stores count it
    among the failures of a server that stopped answering.
    """


class ServerUnavailable(KVWireError, ConnectionError):
    """A call the server did not answer: it is down (not asked), failed, or ran past its deadline.

    `asked` is False when the call was not made because the server is
    known to be down, True when it was made and failed or went unanswered.
    """

    def __init__(self, message: str, *, asked: bool) -> None:
        super().__init__(message)
        self.asked = asked


class NIXLUnavailableError(KVWireError, RuntimeError):
    """NIXL cannot be imported or started here; the message says what to install."""


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
    "ServerUnavailable",
    "StoreReplyError",
    "UnknownEvictionPolicyError",
    "UnknownMediumError",
    "UnreadableWeightsError",
    "VLLMConfigError",
    "ValueRefused",
    "WorkerProcessError",
]
