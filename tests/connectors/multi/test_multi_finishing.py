"""How a MultiConnector finishes a request: answers merged, each keeping child's send awaited."""

from __future__ import annotations

import pytest

from kvwire.connectors.multi._finishing import FinishedSendingTally, merge_finished_answers


def test_the_keeping_children_are_counted_and_their_params_merged() -> None:
    answers = [(True, {"host": "a"}), (False, None), (True, {"port": 1})]

    assert merge_finished_answers(answers) == (2, {"host": "a", "port": 1})


def test_no_params_from_any_child_merge_to_none() -> None:
    assert merge_finished_answers([(False, None), (True, {})]) == (1, None)


def test_a_param_given_by_two_children_is_the_reference_error() -> None:
    with pytest.raises(
        RuntimeError, match=r"Key clash in kv_transfer_params from multiple connectors: \{'host'\}"
    ):
        merge_finished_answers([(True, {"host": "a"}), (True, {"host": "b"})])


def test_a_request_is_reported_finished_at_the_last_keeping_child_s_report() -> None:
    tally = FinishedSendingTally()
    tally.expect([("a", 2)])  # three children keep its blocks

    assert [tally.is_last_report("a") for _ in range(3)] == [False, False, True]


def test_a_request_one_child_keeps_is_reported_at_its_first_report() -> None:
    assert FinishedSendingTally().is_last_report("a") is True
