"""The Redis medium: one key per entry on a Redis/Valkey server or cluster."""
