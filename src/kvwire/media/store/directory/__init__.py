"""The directory medium: one file per entry under a directory engines share (`medium`)."""

from kvwire.media.store.directory.block_store import DirectoryBlockStore
from kvwire.media.store.directory.medium import DirectoryMedium

__all__ = ["DirectoryBlockStore", "DirectoryMedium"]
