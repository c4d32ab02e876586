"""The connectors benchmark's CPU offload and shared storage rows, on a few small blocks.

The figures themselves are the benchmark's to report; what is checked here is
that each row builds its connector as an application does and moves bytes.
"""

from __future__ import annotations

import pathlib

from benchmarks.common import KIB

from benchmarks import connectors

BLOCK = 64 * KIB


def test_the_cpu_offload_row_saves_and_loads_through_a_container_built_connector() -> None:
    row = connectors.bench_cpu_offload(BLOCK, 4 * BLOCK)

    assert row["save_gbps"] > 0
    assert row["load_gbps"] > 0
    assert row["bound_gbps"] > 0


def test_the_shared_storage_row_saves_and_loads_through_a_container_built_connector(
    tmp_path: pathlib.Path,
) -> None:
    row = connectors.bench_shared_storage(BLOCK, 4 * BLOCK, tmp_path)

    assert row["save_gbps"] > 0
    assert row["load_gbps"] > 0
    assert row["read_bound_gbps"] > 0
