"""Fixtures that open a connector's scheduler and worker halves over a shared-storage directory."""

from __future__ import annotations

from tests.support.pairs import open_pair, shared_storage_pair, storage_dir

__all__ = ["open_pair", "shared_storage_pair", "storage_dir"]
