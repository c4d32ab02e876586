"""The memory benchmark's meter and its per-connector figures, on small transfers.

Ratios are not checked against the issue's goal here (the data path decides
them); what is checked is that the meter sees memory and that the figures
count what moved.
"""

from __future__ import annotations

import mmap
import pathlib

import pytest
from benchmarks.common import MIB

from benchmarks import memory

TRANSFER = 8 * MIB


def test_the_meter_sees_a_transient_allocation_after_it_is_freed() -> None:
    meter = memory.PeakMeter()
    # Pages mapped for this test: a heap allocation may reuse pages an earlier
    # test freed and the allocator kept resident, which adds nothing to the
    # resident set (and so to what the meter sees).
    block = mmap.mmap(-1, 64 * MIB)
    block[::4096] = b"x" * len(block[::4096])  # every page touched: resident
    block.close()
    # (Less a little: the interpreter may return some other memory meanwhile.)
    assert meter.peak() >= 60 * MIB
    assert meter.now() < meter.peak()


def test_cpu_offload_moves_every_byte_and_its_pool_is_not_counted_as_extra() -> None:
    pool = memory.pool_bytes(TRANSFER)
    found = memory.measure("CPUOffloadConnector", TRANSFER, {"cpu_pool_bytes": pool}, pool)
    assert found["transfer_bytes"] == found["bytes_saved"] == found["bytes_loaded"] == TRANSFER
    assert found["saves_dropped"] == found["load_errors"] == 0
    assert found["medium_bytes_in_process"] == pool
    assert found["peak_extra_bytes"] == max(
        found["save_peak_extra_bytes"], found["load_peak_extra_bytes"]
    )
    assert found["peak_extra_ratio"] == pytest.approx(found["peak_extra_bytes"] / TRANSFER)


def test_when_the_defaults_drop_saves_it_runs_again_with_the_save_cap_sized_to_the_transfer(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[dict[str, object]] = []

    def measured(
        connector: str, size: int, extra: dict[str, object], medium: int
    ) -> dict[str, object]:
        runs.append(extra)
        return {"saves_dropped": 0 if "max_save_bytes_in_flight" in extra else 3}

    monkeypatch.setattr(memory, "_in_fresh_process", measured)
    rows = memory.measure_connector("SharedStorageConnector", TRANSFER, tmp_path, None)
    assert [row["variant"] for row in rows] == ["defaults", "save cap sized to the transfer"]
    assert "max_save_bytes_in_flight" not in runs[0]
    assert runs[1]["max_save_bytes_in_flight"] >= TRANSFER  # type: ignore[operator]


def test_defaults_that_drop_nothing_are_measured_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "_in_fresh_process", lambda *args: {"saves_dropped": 0})
    rows = memory.measure_connector("SharedStorageConnector", TRANSFER, tmp_path, None)
    assert [row["variant"] for row in rows] == ["defaults"]
