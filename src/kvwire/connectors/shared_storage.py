"""The shared-storage connector: KV blocks in a directory that engines share.

A producer engine saves the blocks it computes; a consumer engine (on the
same host, or over a shared filesystem) loads the longest prefix it finds.
The data path is the store-backed connector's
(:mod:`kvwire.connectors.store_connector`); the medium is
:class:`~kvwire.connectors.file_store.DirectoryBlockStore`.

``kv_connector_extra_config`` keys, beside the common ones of
:class:`~kvwire.connectors.store_connector.StoreConnector`:

- ``shared_storage_path`` (required): the directory; created if missing;
- ``fsync`` (default false): make every entry durable before it is visible;
- ``max_bytes`` (default 0, no cap): evict least recently used entries above it.

Temporary files that writers killed mid-save left behind are never read as
entries; the worker side removes those older than ten minutes when it starts
(and eviction does too).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvwire.connectors.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    bool_key,
    size_key,
    str_key,
)
from kvwire.connectors.file_store import DirectoryBlockStore
from kvwire.connectors.store import BlockStore
from kvwire.connectors.store_connector import StoreConnector

if TYPE_CHECKING:
    import torch


class SharedStorageConnector(StoreConnector):
    """Saves and loads KV blocks as files under ``shared_storage_path``."""

    medium = "disk"

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return (
            *super().extra_config_keys(),
            str_key("shared_storage_path", None, required=True),
            bool_key("fsync", False),
            size_key("max_bytes", 0, minimum=0),
        )

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        path = options["shared_storage_path"]
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            raise ExtraConfigError(
                f"kv_connector_extra_config.shared_storage_path: cannot create {path!r} "
                f"({error.strerror}); expected a writable directory"
            ) from error
        self._directory_store = DirectoryBlockStore(
            path, fsync=options["fsync"], max_bytes=options["max_bytes"]
        )
        return self._directory_store

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        # Writers killed mid-save leave hidden temporary files (never read as
        # entries); clear old ones off the forward pass's thread.
        self._sweeper = threading.Thread(
            target=self._directory_store.sweep_stale_temporary_files,
            name="kvwire-sweep",
            daemon=True,
        )
        self._sweeper.start()

    def shutdown(self) -> None:
        sweeper = getattr(self, "_sweeper", None)
        if sweeper is not None:
            sweeper.join()
        super().shutdown()

    def store_counters(self) -> Mapping[str, float]:
        return self._directory_store.take_counters()

    def reset_cache(self) -> bool | None:
        """Forget this engine layout's entries (other layouts' entries stay)."""
        import shutil

        folder = os.path.join(self._directory_store.root, self.layout.fingerprint_hex)
        shutil.rmtree(folder, ignore_errors=True)
        return not os.path.exists(folder)
