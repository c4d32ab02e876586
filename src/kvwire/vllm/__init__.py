"""kvwire inside vLLM: `KVWireConnector` serves a vLLM engine with any kvwire connector.

In vLLM's `kv_transfer_config`:

```python
{"kv_connector": "KVWireConnector", "kv_role": "kv_both",
 "kv_connector_extra_config": {"kvwire_profile": "cpu-offload"}}
```

`"kvwire_profile"` is a profile kvwire ships, by name (`kvwire profiles`
lists them), or a YAML file's path. (`"kv_connector_module_path":
"kvwire.vllm"` is optional once kvwire is installed: its
`vllm.general_plugins` entry point registers the name.)

Each name is imported on first use, and with it vLLM; `import kvwire` never
imports vLLM. vLLM loads kvwire's general plugin (`kvwire.vllm.plugin`, in
this package) in every process it starts, with or without a kvwire
connector: importing the package alone imports none of the connector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvwire.common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvwire.vllm.connector import KVWireConnector
    from kvwire.vllm.engine_calls import (
        WORKER_EXTENSION,
        KVWireWorkerExtension,
        kvwire_stats,
        wait_for_saves,
    )
    from kvwire.vllm.metadata import KVWireConnectorMetadata
    from kvwire.vllm.stats import KVWireStats

__all__ = [
    "WORKER_EXTENSION",
    "KVWireConnector",
    "KVWireConnectorMetadata",
    "KVWireStats",
    "KVWireWorkerExtension",
    "kvwire_stats",
    "wait_for_saves",
]

_WHERE = {
    "WORKER_EXTENSION": "kvwire.vllm.engine_calls",
    "KVWireConnector": "kvwire.vllm.connector",
    "KVWireConnectorMetadata": "kvwire.vllm.metadata",
    "KVWireStats": "kvwire.vllm.stats",
    "KVWireWorkerExtension": "kvwire.vllm.engine_calls",
    "kvwire_stats": "kvwire.vllm.engine_calls",
    "wait_for_saves": "kvwire.vllm.engine_calls",
}

__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
