"""A medium's transfer handler driven as the block connector drives it, for a medium's own tests."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from kvwire.connectors.offload.transfer_book import TransferBook
from kvwire.media.base import TransferHandler

HandlerT = TypeVar("HandlerT", bound=TransferHandler)


class DrivenHandler(TransferBook, Generic[HandlerT]):
    """``handler`` behind the connector's bookkeeping: loads per step and request, saves, errors.

    ``close`` passes its keywords (a handler's ``timeout_s``) on to the handler.
    """

    handler: HandlerT

    def __init__(self, handler: HandlerT) -> None:
        super().__init__(handler)

    def close(self, **kwargs: Any) -> None:
        self.handler.close(**kwargs)
