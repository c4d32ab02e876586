"""The serving benchmarks' interleaved rounds: order, median and range, checks."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import pytest
from benchmarks.rounds import (
    agreed,
    agreed_cell,
    default_repeats,
    interleaved,
    positive_int,
    rounds_label,
    spread,
    spread_cell,
)

from benchmarks import __main__ as benchmarks_main


def test_every_configuration_runs_once_a_round_every_other_round_in_reverse() -> None:
    order: list[tuple[str, int]] = []

    def measure(name: str, round_index: int, earlier: Mapping[str, str]) -> str:
        order.append((name, round_index))
        return f"{name}{round_index} after {','.join(earlier)}"

    rounds = interleaved(["limit", "a", "b"], 3, measure)

    assert order == [
        *[("limit", 0), ("a", 0), ("b", 0)],
        *[("b", 1), ("a", 1), ("limit", 1)],
        *[("limit", 2), ("a", 2), ("b", 2)],
    ]
    # Keyed in the order named, whatever order they ran in; each saw what ran before it.
    assert list(rounds[1]) == ["limit", "a", "b"]
    assert rounds[1] == {"limit": "limit1 after b,a", "a": "a1 after b", "b": "b1 after "}
    assert rounds[2] == {"limit": "limit2 after ", "a": "a2 after limit", "b": "b2 after limit,a"}


def test_a_spread_is_the_median_and_range_of_the_rounds_that_have_the_figure() -> None:
    assert spread([1.13, 0.98, 1.0]) == {"median": 1.0, "min": 0.98, "max": 1.13, "rounds": 3}
    assert spread([0.5, None]) == {"median": 0.5, "min": 0.5, "max": 0.5, "rounds": 1}
    assert spread([None]) is None
    assert spread_cell(spread([1.13, 0.98, 1.0]), ".2f") == "1.00 (0.98-1.13)"
    assert spread_cell(spread([0.5]), ".2f") == "0.50"
    assert spread_cell(None, ".2f") == "-"


def test_a_figure_that_must_not_move_is_shown_once_or_each_round_marked() -> None:
    assert agreed_cell(agreed([27684.0, 27684.0]), ".0f") == "27684"
    assert agreed_cell(agreed([27684.0, 26564.0]), ".0f") == "27684 / 26564 (differ)"
    assert agreed([{"CPU": 1}, {"CPU": 1}]) == {"same": True, "rounds": [{"CPU": 1}] * 2}


def test_a_table_names_one_round_or_several() -> None:
    assert rounds_label(1) == "1 interleaved round"
    assert rounds_label(3) == "3 interleaved rounds"


def test_repeats_default_to_three_full_and_two_quick_and_refuse_less_than_one() -> None:
    assert default_repeats(quick=False, repeats=None) == 3
    assert default_repeats(quick=True, repeats=None) == 3
    assert default_repeats(quick=True, repeats=5) == 5
    with pytest.raises(ValueError, match="repeats must be at least 1, got 0"):
        default_repeats(quick=False, repeats=0)
    assert positive_int("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1, got 'two'"):
        positive_int("two")


def test_the_command_line_refuses_repeats_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        benchmarks_main.main(["--only", "serve", "--repeats", "0"])

    assert (
        "argument --repeats: expected a whole number of at least 1, got '0'"
        in capsys.readouterr().err
    )


def test_a_huge_repeats_argument_is_shown_cut() -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        positive_int("9" * 100_000 + "x")
    assert len(str(refused.value)) < 200
