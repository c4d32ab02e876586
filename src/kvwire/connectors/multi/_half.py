"""What both halves of a MultiConnector hold: its name and its children, in order.

A MultiConnector builds the half of its role (`MultiSchedulerHalf` or
`MultiWorkerHalf`) over its children, built in that role too, and passes
every call of that role to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwire.interface.base import KVConnectorBase


class MultiHalf:
    """One role's half of a MultiConnector, over its children in order.

    `owner` names the connector in errors about what it was given or told;
    `child_names` name the children as their nested stats and errors do.
    """

    def __init__(
        self, owner: str, children: Sequence[KVConnectorBase], child_names: Sequence[str]
    ) -> None:
        self._owner = owner
        self._children = tuple(children)
        self._child_names = tuple(child_names)
