"""What KVWireConnector's scheduler half sends its worker half each step, as vLLM carries it."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvwire.interface.base import KVConnectorMetadata as KVWireMetadata


@attrs.frozen
class KVWireConnectorMetadata(KVConnectorMetadata):
    """The wrapped kvwire connector's metadata for one step, as vLLM carries it.

    `async_loads`: on a hybrid cache, the block ids (every group's, the
    null block left out) of each asynchronous load planned this step.
    """

    inner: KVWireMetadata
    async_loads: Mapping[str, frozenset[int]] = attrs.field(factory=dict)


def inner_metadata(metadata: KVConnectorMetadata) -> KVWireMetadata:
    """The wrapped connector's metadata within `metadata`; a `TypeError` for any other kind."""
    if not isinstance(metadata, KVWireConnectorMetadata):
        raise TypeError(
            f"KVWireConnector: expected KVWireConnectorMetadata, got {type(metadata).__name__}"
        )
    return metadata.inner
