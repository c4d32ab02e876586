"""The CPU pool medium: preallocated slots in this host's memory (`medium`)."""

from kvwire.media.cpu_pool.medium import CPUPoolMedium

__all__ = ["CPUPoolMedium"]
