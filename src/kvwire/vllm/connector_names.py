"""The names under which kvwire's connectors are registered with vLLM's connector factory.

Read by the `vllm.general_plugins` entry point (`kvwire.vllm.plugin`), which
registers them, and by the startup check (`kvwire.vllm.startup_check`),
which the entry point imports only when a configuration names one of them:
both depend on this module, and it on nothing.
"""

CONNECTORS = ("KVWireConnector",)
"""Each is a class of `kvwire.vllm.connector` by that name."""
