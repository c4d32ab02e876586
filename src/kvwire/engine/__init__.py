"""A small paged-KV inference engine that drives connectors through their real lifecycle."""
