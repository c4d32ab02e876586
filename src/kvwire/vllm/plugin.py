"""vLLM's ``vllm.general_plugins`` entry point: registers kvwire's connectors by name.

vLLM loads general plugins in every process it starts (engine core and
workers included) before it builds a connector, so ``"kv_connector":
"KVWireConnector"`` needs no ``kv_connector_module_path``. Registering only
records the module path: nothing is imported until vLLM asks for the class.
"""

from __future__ import annotations

CONNECTORS = ("KVWireConnector",)


def register() -> None:
    """Register kvwire's vLLM connectors with vLLM's factory (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name in CONNECTORS:
        # vLLM calls every plugin once per process, but a process may load plugins twice.
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, "kvwire.vllm.connector", name)
