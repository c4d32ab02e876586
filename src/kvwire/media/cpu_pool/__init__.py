"""The CPU pool medium: preallocated slots in this host's memory."""
