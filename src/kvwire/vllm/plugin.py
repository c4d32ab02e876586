"""vLLM's `vllm.general_plugins` entry point: registers kvwire's connectors by name.

vLLM loads general plugins in every process it starts (engine core and
workers included) before it builds a connector, so `"kv_connector":
"KVWireConnector"` needs no `kv_connector_module_path`. Registering only
records the module path: the connector is imported when vLLM asks for the
class. Until then this plugin loads only itself, the connectors' names and the
`kvwire` and `kvwire.vllm` packages, whose names are imported on first use.

It also makes `EngineArgs.create_engine_config` check a kvwire profile as
soon as vLLM has built its configuration, before any engine process starts
or the model loads (`kvwire.vllm.startup_check` says why there).
`EngineArgs.__post_init__` loads the plugins, so the first engine of a
process is checked too; a configuration naming none of kvwire's connectors
imports nothing more of kvwire's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kvwire.vllm.connector_names import CONNECTORS

_CHECKS_KVWIRE_PROFILES = "__kvwire_checks_profiles__"


def register() -> None:
    """Register kvwire's vLLM connectors with vLLM's factory (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name in CONNECTORS:
        # vLLM calls every plugin once per process, but a process may load plugins twice.
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, "kvwire.vllm.connector", name)
    check_profiles_when_vllm_builds_its_config()


def check_profiles_when_vllm_builds_its_config() -> None:
    """Wrap `EngineArgs.create_engine_config` (once per process) to check what it built."""
    from vllm.engine.arg_utils import EngineArgs

    create_engine_config = EngineArgs.create_engine_config
    if not getattr(create_engine_config, _CHECKS_KVWIRE_PROFILES, False):
        # On the class: vLLM's AsyncEngineArgs (vllm serve) inherits it.
        EngineArgs.create_engine_config = _checking(create_engine_config)


def _checking(create_engine_config: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(create_engine_config)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = create_engine_config(self, *args, **kwargs)
        transfer = vllm_config.kv_transfer_config
        # A name kvwire registered, or a module path that may hold a subclass of it.
        if transfer is not None and (
            transfer.kv_connector in CONNECTORS or transfer.kv_connector_module_path
        ):
            from kvwire.vllm.startup_check import check_vllm_config

            check_vllm_config(vllm_config)
        return vllm_config

    setattr(checked, _CHECKS_KVWIRE_PROFILES, True)
    return checked
