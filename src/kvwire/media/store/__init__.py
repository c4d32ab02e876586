"""Byte-addressed media: a BlockStore, the handler moving blocks to and from it, StoreMedium."""
