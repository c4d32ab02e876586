"""A fault-injecting medium: another medium whose chosen loads fail (`medium`)."""

from kvwire.testing.faulty_medium.handler import FaultInjectingHandler, LoadFaults, poison_block
from kvwire.testing.faulty_medium.medium import FaultInjectingMedium

__all__ = ["FaultInjectingHandler", "FaultInjectingMedium", "LoadFaults", "poison_block"]
