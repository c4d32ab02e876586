"""A fault-injecting medium: another medium whose chosen loads fail (`medium`)."""

from kvwire.media.faulty.handler import FaultInjectingHandler, LoadFaults, poison_block
from kvwire.media.faulty.medium import FaultInjectingMedium

__all__ = ["FaultInjectingHandler", "FaultInjectingMedium", "LoadFaults", "poison_block"]
