"""The CPU-offload connector, kvwire's default: KV blocks kept in a CPU memory pool.

The block connector (:mod:`kvwire.connectors.offload`) over the CPU pool
medium (:mod:`kvwire.media.cpu_pool.medium`, whose docstring lists its
``kv_connector_extra_config`` keys: ``cpu_pool_bytes``, ``io_threads``,
``transfer_timeout_s``), beside the connector's own ``async_load``. The
scheduler half owns the pool's index and decides every slot; the worker half
owns the pool memory and copies. A saved block becomes visible to lookups
once its request is reported finished sending.
"""

from __future__ import annotations

from kvwire.connectors.offload import OffloadConnector

__all__ = ["CPUOffloadConnector"]


class CPUOffloadConnector(OffloadConnector):
    """Offloads full KV blocks to a preallocated CPU pool and loads them back."""

    default_medium = "cpu_pool"
