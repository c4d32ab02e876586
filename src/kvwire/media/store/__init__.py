"""Media over a key-value store: the BlockStore interface, StoreMedium and its transfer handler.

The stores kvwire ships live beneath: `kvwire.media.store.directory`
(one file per entry) and `kvwire.media.store.redis` (one key per entry
on a Redis/Valkey server or cluster).
"""
