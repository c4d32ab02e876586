"""The hybrid benchmark on the tiny hybrid model: its figures hold and mean what they say.

The figures are byte counts, exact for a given config and workload, so they
are checked against their goals here; times are not checked.
"""

from __future__ import annotations

import pytest

from benchmarks import hybrid
from kvwire.engine.workload import WorkloadSpec


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    # tiny-hybrid: 2 full and 2 sliding layers, a window of 8 tokens (2 blocks of 4).
    setup = hybrid.Setup(
        preset="tiny-hybrid",
        block_size=4,
        workload=WorkloadSpec(num_requests=3, prompt_len=48, output_len=1, shared_prefix_ratio=0.5),
    )
    return hybrid.measure(setup, tmp_path_factory.mktemp("hybrid"))


@pytest.mark.parametrize("connector", hybrid.CONNECTORS)
def test_every_variant_gives_the_window_aware_outputs(
    results: dict[str, object], connector: str
) -> None:
    found = results["connectors"][connector]  # type: ignore[index]
    assert found["outputs_identical"]
    assert all(row["outputs_identical"] for row in found["variants"].values())


@pytest.mark.parametrize("connector", hybrid.CONNECTORS)
def test_window_aware_saving_meets_the_goal_and_the_naive_subclass_saves_more(
    results: dict[str, object], connector: str
) -> None:
    found = results["connectors"][connector]  # type: ignore[index]
    # Below 1: the private registry's every-block subclass was the one built.
    assert found["saved_ratio"] < 1
    assert found["saved_ratio"] <= found["saved_design_bound"] + 1e-9


@pytest.mark.parametrize("connector", hybrid.CONNECTORS)
def test_window_aware_loads_meet_the_goal_against_hma_off(
    results: dict[str, object], connector: str
) -> None:
    found = results["connectors"][connector]  # type: ignore[index]
    rows = found["variants"]
    # Every variant serves every warm prompt, window-aware too: a request
    # whose tail is shorter than the window saved the window at its branch
    # point from the shared prefix.
    for variant in hybrid.VARIANTS:
        assert rows[variant]["warm_hits"] == rows[variant]["warm_requests"] > 0
    assert found["loaded_ratio"] < 1
    assert found["loaded_ratio"] <= found["loaded_goal"] + 1e-9


def test_the_goal_is_the_issue_formula_and_the_design_keeps_a_block_more() -> None:
    from kvwire.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

    model = ModelConfig(
        num_layers=8,
        layer_types=[FULL_ATTENTION] * 2 + [SLIDING_ATTENTION] * 6,
        sliding_window=128,
    )
    layers = hybrid.Layers.of(model, block_size=16)
    # (full + window/prompt x sliding) / all layers, for 2048-token prompts.
    assert layers.goal_ratio([2048, 2048]) == pytest.approx((2 + 6 * 128 / 2048) / 8)
    # A request that moves fewer tokens than the window moves them all.
    assert layers.goal_ratio([64]) == 1.0
    # The planner keeps the window's 8 blocks and the one before.
    assert layers.saved_window_tokens == 144
    assert layers.design_ratio([2048], [2048]) == pytest.approx((2 + 6 * 144 / 2048) / 8)
    # A tail of 64 new tokens may save a whole window of its prompt.
    assert layers.design_ratio([64], [2048]) == pytest.approx((2 * 64 + 6 * 144) / (8 * 64))


def test_the_table_has_a_row_per_connector_and_variant(results: dict[str, object]) -> None:
    table = hybrid.markdown_table(results)
    for connector in ("shared storage", "CPU offload"):
        for variant in hybrid.VARIANTS:
            assert f"| {connector} | {variant} |" in table


def test_registering_the_naive_connectors_leaves_the_default_registry_alone() -> None:
    from kvwire.registry import default_registry

    hybrid.every_block_registry()
    assert default_registry().get_class("SharedStorageConnector").__name__ == (
        "SharedStorageConnector"
    )
    assert default_registry().get_class("CPUOffloadConnector").__name__ == "CPUOffloadConnector"
