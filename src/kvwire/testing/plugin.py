"""kvwire's pytest plugin (entry point `pytest11`): options and fixtures of the kit.

Loaded by pytest in every project that has kvwire installed, so it imports
nothing heavy: the engine (and torch) is imported only by the tests that use
it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvwire.testing.instruments import Instruments


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvwire", "kvwire connector conformance kit")
    group.addoption(
        "--kvwire-no-strict-roles",
        action="store_true",
        default=False,
        help="let a connector answer calls of the other role (strict roles are on by default)",
    )


@pytest.fixture
def kvwire_strict_roles(request: pytest.FixtureRequest) -> bool:
    """Whether connectors under test fail loudly when asked a question of the other role."""
    return not request.config.getoption("--kvwire-no-strict-roles")


@pytest.fixture
def kvwire_instruments(kvwire_strict_roles: bool) -> Instruments:
    """The connector hook the kit hands to the engine: strict roles, no call log."""
    from kvwire.testing.instruments import Instruments

    return Instruments(strict_roles=kvwire_strict_roles)
