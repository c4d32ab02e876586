"""The shared-storage connector: KV blocks as files in a directory many engines share.

The block connector (:mod:`kvwire.connectors.offload`) over the directory
medium (:mod:`kvwire.media.store.directory.medium`, whose docstring lists its
``kv_connector_extra_config`` keys: ``shared_storage_path``, ``fsync``,
``max_bytes``, ``file_mode``, ``allow_other_owner``, and the store keys of
:mod:`kvwire.media.store.medium`), beside the connector's own ``async_load``.
"""

from __future__ import annotations

from kvwire.connectors.offload import OffloadConnector

__all__ = ["SharedStorageConnector"]


class SharedStorageConnector(OffloadConnector):
    """Saves and loads KV blocks as files under ``shared_storage_path``."""

    default_medium = "directory"
