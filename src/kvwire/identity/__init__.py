"""What names a model's KV: the digests of its weight files, its identity, its adapters' keys."""
