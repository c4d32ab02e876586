"""A read's pieces become as few NIXL descriptors as their addresses allow."""

from __future__ import annotations

from kvwire.media.peer._agent import coalesce


def test_pieces_adjacent_here_and_at_the_peer_are_one_run() -> None:
    pieces = [(1000, 5000), (1100, 5100), (1200, 5200)]

    assert coalesce(pieces, 100) == [(1000, 5000, 300)]


def test_a_gap_on_either_side_starts_a_new_run() -> None:
    pieces = [
        (1000, 5000),
        (1100, 5100),
        (1200, 9000),  # adjacent here, not at the peer
        (1400, 9100),  # adjacent at the peer, not here
        (1500, 9200),
        (1000, 9300),  # before its predecessor here
    ]

    assert coalesce(pieces, 100) == [
        (1000, 5000, 200),
        (1200, 9000, 100),
        (1400, 9100, 200),
        (1000, 9300, 100),
    ]


def test_no_pieces_are_no_runs() -> None:
    assert coalesce([], 100) == []
