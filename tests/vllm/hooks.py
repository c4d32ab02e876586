"""Container hooks the tests name in ``kvwire_container_hook``: they override providers of the
container KVWireConnector builds inside vLLM, as a deployment would."""

from __future__ import annotations

from collections.abc import Sequence

from dependency_injector import containers, providers

from kvwire.connector.types import BlockHash
from kvwire.connectors.cpu_offload import CPUOffloadConnector


class NeverHitCPUOffload(CPUOffloadConnector):
    """CPU offload whose pool never reports a block as held: every lookup misses."""

    def count_held_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        return 0


def never_hit(container: containers.Container) -> None:
    container.connector_class.override(providers.Object(NeverHitCPUOffload))
