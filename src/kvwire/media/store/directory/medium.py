"""The directory medium: one file per entry under a directory that engines share.

A producer engine saves the blocks it computes; a consumer engine (on the
same host, or over a shared filesystem) loads the longest prefix it finds.
The data path is every store medium's (`kvwire.media.store.medium`);
the store is `DirectoryBlockStore`, which reads and writes an entry's
ranges straight from and into the KV cache (`preadv`/`pwritev`). Its
blocks appear in KV cache events as medium `disk`.

`kv_connector_extra_config` keys, beside the common ones of
`kvwire.media.StoreMedium`:

- `shared_storage_path` (required): the directory; created if missing
  (with the folder mode of `file_mode`). It may hold other files: kvwire
  only ever removes its own entries and temporary files, in its own folders;
- `fsync` (default false): make every entry durable before it is visible;
- `page_cache` (default `keep`): `drop` keeps entries out of the host's page
  cache: each is written to the disk (`fdatasync`) and its pages dropped
  once written, and again once read. For a store much larger than memory,
  or in a container whose page cache counts against its memory limit:
  entries then cost the host no memory, and every read comes from the disk;
- `max_bytes` (default 0, no cap): evict least recently used entries above it;
- `file_mode` (default `private`): who may read the entries, which can
  reveal prompts. `private`: this user only (entries 0600, folders 0700);
  `group`: also the directory's group, for engines that run as different
  users of one group (entries 0660, folders 2770). Exact whatever the umask;
- `allow_other_owner` (default false): use a directory that another user
  owns. Refused otherwise: whoever owns it can read every entry and plant
  forged ones.

Temporary files that writers killed mid-save left behind are never read as
entries; the worker half removes those older than ten minutes when it starts
(and eviction does too).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from kvwire.common.redaction import shown
from kvwire.config.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    bool_key,
    size_key,
    str_key,
)
from kvwire.media.base import MediumContext, TransferHandler
from kvwire.media.store.base import BlockStore
from kvwire.media.store.directory._modes import (
    FILE_MODE_NAMES,
    FileModes,
    file_modes,
    make_folder,
    owner_problem,
    writers_beyond,
)
from kvwire.media.store.directory.block_store import DirectoryBlockStore
from kvwire.media.store.medium import StoreMedium

__all__ = ["SWEEP_JOIN_S", "DirectoryBlockStore", "DirectoryMedium"]

logger = logging.getLogger(__name__)

# How long shutdown waits for the start-up sweep (a hung network filesystem
# must not hang the engine's exit); past it the sweep is left to finish alone.
SWEEP_JOIN_S = 10.0


def _path_key(name: str) -> ExtraConfigKey:
    """A required directory path: a non-empty string that the system can open (no NUL byte)."""

    def convert(value: Any) -> str | None:
        return value if isinstance(value, str) and value and "\0" not in value else None

    return attrs.evolve(
        str_key(name, None, required=True),
        convert=convert,
        accepted="a non-empty directory path without NUL bytes (required)",
    )


def _file_mode_key(name: str) -> ExtraConfigKey:
    return ExtraConfigKey(
        name,
        "private",
        lambda value: value if isinstance(value, str) and value in FILE_MODE_NAMES else None,
        '"private" (entries 0600, folders 0700) or "group" (entries 0660, folders 2770)',
    )


def _page_cache_key(name: str) -> ExtraConfigKey:
    return ExtraConfigKey(
        name,
        "keep",
        lambda value: value if value in ("keep", "drop") else None,
        '"keep" (entries stay in the page cache as the system decides) or "drop" '
        "(written to the disk and dropped from the page cache after each write and read)",
    )


def _make_directory(path: str, modes: FileModes) -> None:
    """Create the directory `path` if missing (itself with `modes`, its parents as usual)."""
    if os.path.isdir(path):
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        make_folder(path, modes)
    except FileExistsError:
        # Another engine created it meanwhile; anything but a folder is an error.
        if not os.path.isdir(path):
            raise


class DirectoryMedium(StoreMedium[BlockStore]):
    """KV blocks as files under `shared_storage_path`, one per entry.

    A subclass may wrap the store `create_store` returns (a test's
    fault, a hold); the directory's own operations (the sweep, its counters,
    a reset) still reach the directory store itself.
    """

    event_medium: ClassVar[str] = "disk"

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        # The worker half's start-up sweep, joined (for a while) at close.
        self._sweeper: threading.Thread | None = None
        self._directory: DirectoryBlockStore | None = None

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return (
            *super().extra_config_keys(),
            _path_key("shared_storage_path"),
            bool_key("fsync", False),
            size_key("max_bytes", 0, minimum=0),
            _file_mode_key("file_mode"),
            bool_key("allow_other_owner", False),
            _page_cache_key("page_cache"),
        )

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        """The store over `shared_storage_path`, created if missing, its owner checked."""
        path = options["shared_storage_path"]
        modes = file_modes(options["file_mode"])
        try:
            _make_directory(path, modes)
            problem = None if options["allow_other_owner"] else owner_problem(path)
        except OSError as error:
            raise ExtraConfigError(
                f"kv_connector_extra_config.shared_storage_path: cannot create {shown(path)} "
                f"({error.strerror}); expected a writable directory"
            ) from error
        if problem is not None:
            raise ExtraConfigError(
                f"kv_connector_extra_config.shared_storage_path: {shown(path)} {problem}; expected "
                "a directory of this user (its owner can read every entry and plant forged "
                "ones), or kv_connector_extra_config.allow_other_owner: true to trust its owner"
            )
        writers = writers_beyond(path, modes)
        if writers is not None:
            # kvwire's own folders keep them from reading entries, not from
            # creating folders of their own in kvwire's names beforehand.
            logger.warning(
                "shared storage %s: %s may write in this directory, and so put entries there "
                "that this engine loads; make it writable only by those file_mode %s shares with",
                shown(path),
                writers,
                modes.name,
            )
        self._directory = DirectoryBlockStore(
            path,
            entry_bytes=self.layout.entry_bytes,
            fsync=options["fsync"],
            max_bytes=options["max_bytes"],
            modes=modes,
            drop_from_page_cache=options["page_cache"] == "drop",
        )
        return self._directory

    @property
    def directory_store(self) -> DirectoryBlockStore:
        """The directory store itself, under whatever a subclass wrapped it in."""
        self.store  # noqa: B018 - creates it on first use
        assert self._directory is not None, "create_store did not build the directory store"
        return self._directory

    def start_sweeper(self, handler: TransferHandler) -> None:
        # Writers killed mid-save leave hidden temporary files (never read as
        # entries); clear old ones off the forward pass's thread.
        self._sweeper = threading.Thread(
            target=self.directory_store.sweep_stale_temporary_files,
            name="kvwire-sweep",
            daemon=True,
        )
        self._sweeper.start()

    def stop_sweeper(self) -> None:
        sweeper = self._sweeper
        if sweeper is None:
            return
        sweeper.join(SWEEP_JOIN_S)
        if sweeper.is_alive():
            logger.warning(
                "shared storage %s: the sweep of dead writers' temporary files still "
                "runs after %.0f s; shutting down without waiting for it",
                shown(self.directory_store.root),
                SWEEP_JOIN_S,
            )

    def store_counters(self) -> Mapping[str, float]:
        return self.directory_store.take_counters()

    def reset_store(self) -> bool:
        """Forget this engine's entries, of every KV cache group (other layouts' and files stay)."""
        # Every group's removal runs, even after one leaves entries behind.
        store = self.directory_store
        left = [not store.remove_layout(layout.fingerprint_hex) for layout in self.stored_layouts]
        return not any(left)
