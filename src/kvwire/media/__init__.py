"""Media: where connectors keep KV blocks (a CPU pool, a directory, Redis), each a plug-in."""
