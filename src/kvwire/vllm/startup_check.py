"""A kvwire profile named in vLLM's configuration, checked before vLLM loads the model.

vLLM builds a KV connector only once the model is loaded: the engine core
starts the executor, whose workers load the model and then build their
connector with the KV cache, and builds the scheduler's connector after
that (`EngineCore.__init__` in `vllm/v1/engine/core.py`). A bad profile
found by the connector is reported tens of seconds (minutes, for a real
model) into a start, in a worker's traceback. vLLM asks the connector's
class nothing earlier that sees the configuration: while it builds its
`VllmConfig` it only checks `issubclass(cls, SupportsHMA)`. The one
kvwire code vLLM runs before is the `vllm.general_plugins` entry point
(`kvwire.vllm.plugin`), which `EngineArgs.__post_init__` loads before
anything calls `create_engine_config`, and which is handed no
configuration. So the entry point wraps `EngineArgs.create_engine_config`:
once vLLM has built its configuration, `check_vllm_config` runs on it,
and `LLM(...)`, `vllm serve` and any `create_engine_config()` raise its
one error, naming the field, before an engine process starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kvwire.common.plugin_calls import contained_exits, plugin_message
from kvwire.config.profile import profile_origin
from kvwire.container import container_for_profile
from kvwire.exceptions import KVWireError, ModelIdentityError, VLLMConfigError
from kvwire.identity.file_digests import default_cache_directory
from kvwire.vllm.config_bridge import (
    INLINE_PROFILE_KEY,
    PROFILE_PATH_KEY,
    config_before_kv_cache,
    container_hook,
    read_kvwire_profile,
    run_container_hook,
)
from kvwire.vllm.connector_names import CONNECTORS
from kvwire.vllm.weight_stamps import record_weight_stamps

__all__ = ["check_vllm_config"]


def check_vllm_config(vllm_config: Any) -> None:
    """Check the kvwire profile of `vllm_config`'s KVWireConnector as its connector will.

    Nothing happens unless `kv_transfer_config` names `KVWireConnector`
    (or a subclass). Then, as the connector does when vLLM builds it: the
    platform is a CPU; `kv_connector_extra_config`'s keys; the profile
    read and validated; the connector the profile wraps named; the tensor
    parallel size and KV dtype kvwire serves; the container hook imported
    and run on a container of its own; the wrapped connector and its medium
    resolved (an unknown name, a module that cannot be imported, an extra
    not installed); and their extra config validated as `kvwire check`
    does; `KVWIRE_DIGEST_CACHE`'s value. What needs the loaded model waits
    for the connector: the model's identity (a digest of its weights) and
    the hybrid KV cache's groups. Then the stamps of the model's files are
    put in `vllm_config` (`kvwire.vllm.weight_stamps`), so that the
    identity is of the files vLLM loads after this.

    Raises `VLLMConfigError`; an error in the profile's content names
    the extra-config key the profile was given under, then the profile's field.
    """
    transfer = vllm_config.kv_transfer_config
    if not _names_kvwire_connector(transfer):
        return
    from kvwire.vllm.connector import require_cpu_platform

    require_cpu_platform()
    extra_config = dict(transfer.kv_connector_extra_config or {})
    given_as = INLINE_PROFILE_KEY if INLINE_PROFILE_KEY in extra_config else PROFILE_PATH_KEY
    profile_key = f"kv_transfer_config.kv_connector_extra_config.{given_as}"
    named = extra_config.get(PROFILE_PATH_KEY)
    if given_as == PROFILE_PATH_KEY and isinstance(named, str):
        # The file to fix (or the shipped profile's name), as given.
        profile_key += f" ({profile_origin(named)})"
    with _named(profile_key):
        engine_config = config_before_kv_cache(vllm_config, read_kvwire_profile(extra_config))
        container = container_for_profile(engine_config)
        hook = container_hook(extra_config)
        if hook is not None:
            run_container_hook(hook, container)
        registry = container.registry()
        wrapped = container.kv_transfer_config()
    with _named(profile_key, "kv_transfer_config.kv_connector"):
        if not container.connector_class.overridden:
            registry.check_module_path(wrapped)
        connector_cls = container.connector_class()
    with _named(profile_key, "kv_transfer_config.kv_connector_extra_config"), contained_exits():
        connector_cls.validate_extra_config(wrapped, registry)
    with _named(profile_key, "kv_transfer_config.kv_connector_extra_config.medium"):
        # The medium the connector will build with, a container hook's override included.
        container.medium_class()
    try:
        default_cache_directory()
    except ModelIdentityError as error:
        raise VLLMConfigError(str(error)) from None
    record_weight_stamps(vllm_config)


@contextlib.contextmanager
def _named(profile_key: str, field: str = "") -> Iterator[None]:
    """An error raised inside becomes one `VLLMConfigError` naming where it is.

    `profile_key`: vLLM's extra-config key the profile was given under.
    kvwire's own errors name the profile's field (or the profile) and show
    no secret; anything else (vLLM's text for an unknown connector, a
    plug-in's module or hook) is named by `field`, the profile's field,
    and shown as its type and message, redacted and bounded.
    """
    try:
        yield
    except VLLMConfigError:
        raise  # names vLLM's field already (an extra-config key, the container hook, the model)
    except KVWireError as error:
        raise VLLMConfigError(f"{profile_key}: {error}") from None
    except Exception as error:
        where = f"{profile_key}: {field}" if field else profile_key
        raise VLLMConfigError(f"{where}: {plugin_message(error)}") from None


def _names_kvwire_connector(transfer: Any) -> bool:
    if transfer is None or transfer.kv_connector is None:
        return False
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvwire.vllm.connector import KVWireConnector

    try:
        connector_cls = KVConnectorFactory.get_connector_class(transfer)
    except Exception:
        if transfer.kv_connector in CONNECTORS:
            # kvwire's name at a module path vLLM cannot load: vLLM's own error, now.
            raise
        # Another connector, perhaps not kvwire's: vLLM says why when it builds it.
        return False
    return isinstance(connector_cls, type) and issubclass(connector_cls, KVWireConnector)
