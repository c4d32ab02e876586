"""The peer medium: engines read each other's CPU pools over NIXL (:mod:`.medium`)."""

from kvwire.media.peer.medium import PeerMedium

__all__ = ["PeerMedium"]
