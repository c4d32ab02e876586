"""Interleaved rounds for the serving benchmarks: every configuration once per round.

A host's speed drifts over minutes (other work, page cache, thermal state):
running all of one configuration and then all of the next lets that drift
pass for a difference between them. Rounds run A B C, C B A, A B C, ..., the
limit among them: every configuration once a round, every other round in the
reverse order, so that a drift through a round favours no place in it and a
steady one cancels over each pair of rounds. Each configuration is set
against the limit of its own round; the median ratio over rounds, with its
range, then says what is a difference and what is noise. Figures that must
not move from round to round (computed tokens on the same requests, outputs
equal to the limit's) are checked with :func:`agreed`, not averaged.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from kvwire.common.redaction import shown

Result = TypeVar("Result")

# Three rounds even for a quick run: the median of two is their mean, which one round
# disturbed by other work on the host moves by half its disturbance; a median of three is
# the undisturbed rounds' figure.
FULL_REPEATS = 3
QUICK_REPEATS = 3


def default_repeats(quick: bool, repeats: int | None) -> int:
    """``repeats`` if given (at least 1), else the default of a full or a quick run."""
    if repeats is None:
        return QUICK_REPEATS if quick else FULL_REPEATS
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    return repeats


def positive_int(text: str) -> int:
    """``--repeats``, ``--passes``: a whole number, at least 1 (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of at least 1, got {shown(text, limit=40)}"
        )
    return value


def interleaved(
    names: Sequence[str],
    repeats: int,
    measure: Callable[[str, int, Mapping[str, Result]], Result],
) -> list[dict[str, Result]]:
    """Each round's result of every configuration, keyed in the order named.

    Even rounds (the first is 0) measure in the order named, odd rounds in
    the reverse order. ``measure(name, round_index, earlier)`` gets the
    round's results so far, for a configuration chosen from those before it.
    """
    rounds: list[dict[str, Result]] = []
    for round_index in range(repeats):
        print(f"  round {round_index + 1} of {repeats}", flush=True)
        order = names if round_index % 2 == 0 else names[::-1]
        results: dict[str, Result] = {}
        for name in order:
            results[name] = measure(name, round_index, results)
        rounds.append({name: results[name] for name in names})
    return rounds


def rounds_label(repeats: int) -> str:
    """``1 interleaved round``, ``3 interleaved rounds``: how a table names its rounds."""
    return f"{repeats} interleaved round{'' if repeats == 1 else 's'}"


def spread(values: Sequence[float | None]) -> dict[str, float] | None:
    """The median of the values and their range (``min``, ``max``), or None if there are none.

    A round without the figure (a failed server, a limit of 0) is left out.
    """
    present = [value for value in values if value is not None]
    if not present:
        return None
    return {
        "median": round(statistics.median(present), 3),
        "min": round(min(present), 3),
        "max": round(max(present), 3),
        "rounds": len(present),
    }


def spread_cell(figures: Mapping[str, float] | None, form: str) -> str:
    """``0.95 (0.90-1.01)``: the median and, with more than one round, the range."""
    if figures is None:
        return "-"
    median = format(figures["median"], form)
    if figures["rounds"] == 1:
        return median
    return f"{median} ({figures['min']:{form}}-{figures['max']:{form}})"


def agreed(values: Sequence[Any]) -> dict[str, Any]:
    """Whether a figure that must not move was the same in every round; each round's value."""
    return {"same": all(value == values[0] for value in values), "rounds": list(values)}


def agreed_cell(check: Mapping[str, Any], form: str = "") -> str:
    """The value where every round agreed; else each round's, ``/`` between, marked."""
    values = [format(value, form) for value in check["rounds"]]
    if not values:
        return "-"
    if check["same"]:
        return values[0]
    return f"{' / '.join(values)} (differ)"
