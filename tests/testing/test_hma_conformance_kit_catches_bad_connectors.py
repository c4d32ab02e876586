"""The kit's hybrid-model checks fail connectors that serve KV cache groups wrongly.

Each bad connector is a built-in with one rule broken (tests.support.misbehaving_connectors);
the suite runs on it in a pytester sandbox, and the check meant for that rule fails.
"""

from __future__ import annotations

import pytest

# Imported here, outside the sandboxed runs: pytester forgets the modules a run
# imported, while the process-wide registry keeps the medium classes it loaded,
# so a later run's fresh kvwire.media.base would not be the base of those.
import kvwire.media.cpu_pool  # noqa: F401

pytest_plugins = ["pytester"]

SUITE = """
import pytest
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config
from tests.support.misbehaving_connectors import {name}

class TestBad(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path):
        return conformance_engine_config({name}, extra_config={extra})
"""


def assert_the_kit_fails(
    pytester: pytest.Pytester, name: str, extra: str, test: str, lines: list[str]
) -> None:
    """Run the checks matching ``test`` on connector ``name``: each fails, saying ``lines``."""
    pytester.makepyfile(test_bad=SUITE.format(name=name, extra=extra))
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-k", test)
    result.assert_outcomes(failed=len(test.split(" or ")))
    result.stdout.fnmatch_lines(lines)


def test_the_kit_fails_a_connector_that_saves_every_block_of_a_sliding_window_group(
    pytester: pytest.Pytester,
) -> None:
    assert_the_kit_fails(
        pytester,
        "EveryBlockCPUOffloadConnector",
        '{"cpu_pool_bytes": "4MiB"}',
        "moves_only_blocks_inside_the_sliding_window",
        ["*bytes_saved: * with HMA on, * with one KV cache group*"],
    )


def test_the_kit_fails_a_connector_whose_block_aligned_prompts_get_no_warm_hit_with_hma_on(
    pytester: pytest.Pytester,
) -> None:
    assert_the_kit_fails(
        pytester,
        "WindowOnlyCPUOffloadConnector",
        '{"cpu_pool_bytes": "4MiB"}',
        "moves_only_blocks_inside_the_sliding_window",
        ["*/warm: the warm pass loaded 0 tokens with HMA on, * with one KV cache group*"],
    )


def test_the_kit_fails_a_connector_that_loads_one_groups_bytes_into_another(
    pytester: pytest.Pytester,
) -> None:
    assert_the_kit_fails(
        pytester,
        "GroupBlindSharedStorageConnector",
        '{"shared_storage_path": str(tmp_path / "store")}',
        "round_trips_every_kv_cache_group",
        ["*: KV cache group * (layers [[]*[]]) differs after loading*"],
    )


def test_the_kit_fails_a_connector_that_writes_the_null_block_though_outputs_stay_equal(
    pytester: pytest.Pytester,
) -> None:
    assert_the_kit_fails(
        pytester,
        "NullBlockWritingCPUOffloadConnector",
        '{"cpu_pool_bytes": "4MiB"}',
        "round_trips_every_kv_cache_group or moves_only_blocks_inside_the_sliding_window",
        [
            "*: KV cache group 1 (layers [[]0, 2[]]) differs after loading*",
            "*the null block (id 0*) was written*",
        ],
    )
