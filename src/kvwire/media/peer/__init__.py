"""The peer medium: engines read each other's CPU pools over NIXL (`medium`)."""

from kvwire.media.peer.medium import PeerMedium

__all__ = ["PeerMedium"]
