"""kvwire inside vLLM: `KVWireConnector` serves a vLLM engine with any kvwire connector.

Importing this package imports vLLM; `import kvwire` never does. In vLLM's
`kv_transfer_config`:

```python
{"kv_connector": "KVWireConnector", "kv_role": "kv_both",
 "kv_connector_extra_config": {"kvwire_profile": "cpu-offload"}}
```

`"kvwire_profile"` is a profile kvwire ships, by name (`kvwire profiles`
lists them), or a YAML file's path. (`"kv_connector_module_path":
"kvwire.vllm"` is optional once kvwire is installed: its
`vllm.general_plugins` entry point registers the name.)
"""

from kvwire.vllm.connector import KVWireConnector, KVWireConnectorMetadata
from kvwire.vllm.engine_calls import (
    WORKER_EXTENSION,
    KVWireWorkerExtension,
    kvwire_stats,
    wait_for_saves,
)
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
