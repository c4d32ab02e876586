"""Byte-addressed media: a BlockStore and the worker-side handler moving blocks to and from it."""
