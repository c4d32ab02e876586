"""NIXL itself, as the peer medium uses it: two processes, UCX over loopback, DRAM to DRAM."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvwire.media.peer._agent import PeerAgent
from tests.support.processes.nixl_holder import pattern

pytestmark = pytest.mark.slow

SIZE = 4 * 2**20
_ROOT = pathlib.Path(__file__).resolve().parents[3]


Holder = tuple[subprocess.Popen[str], str, dict[str, Any]]


@pytest.fixture(scope="module")
def holder() -> Iterator[Holder]:
    """A holder the tests share (they only read from it)."""
    yield from _holder()


@pytest.fixture
def own_holder() -> Iterator[Holder]:
    """A holder for one test, which may kill it."""
    yield from _holder()


def _holder() -> Iterator[Holder]:
    name = f"holder-{uuid.uuid4().hex[:8]}"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.processes.nixl_holder", name, str(SIZE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=_ROOT,
        env={**os.environ, "PYTHONPATH": str(_ROOT)},
        text=True,
    )
    try:
        assert process.stdout is not None
        line = next(line for line in process.stdout if line.startswith("{"))
        yield process, name, json.loads(line)
    finally:
        process.kill()
        process.wait(30)


def test_a_read_from_another_process_brings_its_bytes(holder: Holder) -> None:
    _, name, held = holder
    local = torch.zeros(SIZE, dtype=torch.uint8)
    agent = PeerAgent(f"reader-{uuid.uuid4().hex[:8]}", [local])
    try:
        assert agent.knows(name, bytes.fromhex(held["metadata"]))
        # Two pieces, swapped: each lands where it was asked to.
        half = SIZE // 2
        pieces = [
            (local.data_ptr(), held["address"] + half),
            (local.data_ptr() + half, held["address"]),
        ]
        status = agent.read(name, pieces, half, time.monotonic() + 30, on_late_end=lambda: None)

        assert status == "done"
        expected = pattern(SIZE)
        assert torch.equal(local[:half], expected[half:])
        assert torch.equal(local[half:], expected[:half])
    finally:
        agent.close()


def test_adjacent_pieces_read_as_one_run_bring_every_byte(holder: Holder) -> None:
    _, name, held = holder
    local = torch.zeros(SIZE, dtype=torch.uint8)
    agent = PeerAgent(f"reader-{uuid.uuid4().hex[:8]}", [local])
    try:
        assert agent.knows(name, bytes.fromhex(held["metadata"]))
        # Three adjacent quarters (one run), then the first quarter again elsewhere.
        quarter = SIZE // 4
        pieces = [(local.data_ptr() + i * quarter, held["address"] + i * quarter) for i in range(3)]
        pieces.append((local.data_ptr() + 3 * quarter, held["address"]))
        status = agent.read(name, pieces, quarter, time.monotonic() + 30, on_late_end=lambda: None)

        assert status == "done"
        expected = pattern(SIZE)
        assert torch.equal(local[: 3 * quarter], expected[: 3 * quarter])
        assert torch.equal(local[3 * quarter :], expected[:quarter])
    finally:
        agent.close()


def test_reads_outside_the_holders_memory_or_from_a_dead_holder_fail_at_once(
    own_holder: Holder,
) -> None:
    process, name, held = own_holder
    local = torch.zeros(SIZE, dtype=torch.uint8)
    agent = PeerAgent(f"reader-{uuid.uuid4().hex[:8]}", [local])
    try:
        assert agent.knows(name, bytes.fromhex(held["metadata"]))
        outside = [(local.data_ptr(), held["address"] + SIZE)]
        assert agent.read(name, outside, 4096, time.monotonic() + 30, lambda: None) == "failed"

        process.kill()
        process.wait(30)
        started = time.monotonic()
        inside = [(local.data_ptr(), held["address"])]
        status = agent.read(name, inside, 4096, time.monotonic() + 30, lambda: None)

        assert status == "failed"
        assert time.monotonic() - started < 10
        assert not local.any()
    finally:
        agent.close()


def test_metadata_of_another_name_is_not_taken_for_the_peer(holder: Holder) -> None:
    _, _, held = holder
    agent = PeerAgent(f"reader-{uuid.uuid4().hex[:8]}", [torch.zeros(16, dtype=torch.uint8)])
    try:
        assert not agent.knows("someone-else", bytes.fromhex(held["metadata"]))
        assert not agent.knows("someone-else", b"not metadata")
    finally:
        agent.close()
