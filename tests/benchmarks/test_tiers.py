"""The tiers benchmark: Belady's optimum on traces counted by hand, and a quick run."""

from __future__ import annotations

import json
import pathlib

from benchmarks import tiers
from kvwire.replay.sweep import SAVE_THRESHOLDS
from kvwire.replay.synthetic import SHAPES


def blocks(text: str) -> list[bytes]:
    return [letter.encode() for letter in text]


def test_belady_keeps_the_block_used_soonest_and_may_refuse_the_new_one() -> None:
    # Capacity 2. At c (position 2) a's next use (3) and b's (4) are sooner than
    # c's (5): c is not kept. a and b hit at 3 and 4, a again at 6: 3 hits.
    # Keeping every new block would evict b for c and hit only a at 3 and c at 5.
    assert tiers.belady_hits(blocks("abcabca"), 2) == 3


def test_belady_evicts_the_block_used_again_farthest() -> None:
    # Capacity 2. At c (position 2): a is next used at 3, b at 5, c at 4: b is
    # evicted for c. a hits at 3, c at 4, b misses at 5: 2 hits (LRU: 1).
    assert tiers.belady_hits(blocks("abcacb"), 2) == 2


def test_belady_with_room_for_everything_misses_only_first_uses() -> None:
    trace = blocks("abcabcdd")
    assert tiers.belady_hits(trace, 4) == len(trace) - len(set(trace))


def test_knowing_reuse_saves_a_prompt_up_to_its_first_block_never_asked_for_again() -> None:
    a, b, c, d = blocks("abcd")
    choose = tiers.saves_asked_again([[a, b], [a, c, d], [a, b]])
    assert choose(0, [a, b]) == [a, b]
    # c and d are not asked for after request 1: nothing of them is saved.
    assert choose(1, [c, d]) == []
    assert choose(2, [a, b]) == []


def test_the_fixed_best_holds_the_blocks_asked_for_most_and_misses_their_first_use() -> None:
    # a 3 uses, b 2, c 1: holding a and b hits 2 + 1.
    assert tiers.fixed_best_hits(blocks("abcaba"), 2) == 3
    assert tiers.fixed_best_hits(blocks("abcaba"), 10) == 6 - 3


def test_a_quick_run_reports_every_policy_below_the_optimum(tmp_path: pathlib.Path) -> None:
    headline = tiers.run(tmp_path, quick=True)
    result = json.loads((tmp_path / "tiers.json").read_text())
    [pool] = result["pools"]
    rows = {(row["eviction"], row["save_threshold"]): row for row in pool["configurations"]}
    assert set(rows) == {(policy, 1) for policy in tiers.POLICIES} | {
        (policy, 2) for policy in tiers.POLICIES
    }
    assert result["distinct_blocks"] > 3 * pool["capacity_blocks"]
    for row in rows.values():
        assert 0 < row["of_belady"] <= 1
    # Admission saves fewer blocks: the one-off prompts' are refused.
    for policy in tiers.POLICIES:
        assert rows[(policy, 2)]["saved_blocks"] < rows[(policy, 1)]["saved_blocks"] / 2
        assert rows[(policy, 2)]["saves_not_admitted"] > 0
    assert headline == tiers.summary(result)
    assert headline["256"]["lru_threshold_1"] == round(rows[("lru", 1)]["of_belady"], 3)
    assert "| arc | 2 |" in (tmp_path / "tiers.md").read_text()


def test_a_quick_run_measures_every_shape_at_a_fraction_of_its_blocks(
    tmp_path: pathlib.Path,
) -> None:
    headline = tiers.run(tmp_path, quick=True)
    result = json.loads((tmp_path / "tiers.json").read_text())
    assert [shape["shape"] for shape in result["shapes"]] == list(SHAPES)
    table = (tmp_path / "tiers.md").read_text()
    for shape in result["shapes"]:
        [size] = shape["sizes"]
        assert size["capacity_blocks"] == round(tiers.QUICK_FRACTIONS[0] * shape["distinct_blocks"])
        configurations = {
            (row["eviction"], row["save_threshold"]) for row in size["configurations"]
        }
        assert configurations == {
            (policy, threshold) for policy in tiers.POLICIES for threshold in SAVE_THRESHOLDS
        }
        for row in size["configurations"]:
            assert 0 < row["of_belady"] <= 1
            assert row["microseconds_per_block"] > 0
        assert set(size["references"]) == {
            "fixed_best",
            *(f"{policy}_knowing_reuse" for policy in tiers.KNOWING_REUSE),
        }
        for reference in size["references"].values():
            assert 0 < reference["of_belady"] <= 1
        assert headline[f"{shape['shape']} 0.05"]["kvfifo_threshold_1"] == round(
            size["configurations"][2 * tiers.POLICIES.index("kvfifo")]["of_belady"], 3
        )
        assert f"| {shape['shape']} | {size['capacity_blocks']} (5%) |" in table
    assert "| lru knowing reuse | kvfifo knowing reuse |" in table


def test_the_trace_is_the_same_every_run() -> None:
    assert tiers.generate_trace(tiers.QUICK) == tiers.generate_trace(tiers.QUICK)


def test_the_tiered_medium_computes_each_block_about_once_and_spill_writes_no_more(
    tmp_path: pathlib.Path,
) -> None:
    tiers.run(tmp_path, quick=True)
    [pool] = json.loads((tmp_path / "tiers.json").read_text())["pools"]
    rows = {(row["configuration"], row["save_threshold"]): row for row in pool["tiered"]}
    multi = rows[("MultiConnector lru write-through", 1)]
    through = rows[("tiered lru write_through", 1)]
    spill = rows[("tiered lru spill", 1)]
    # The disk holds every block written to it: only first sights are computed.
    distinct = multi["disk_blocks_written"]
    assert through["computed_blocks"] <= distinct * 1.01 < multi["computed_blocks"]
    assert spill["computed_blocks"] <= distinct * 1.01
    assert spill["disk_blocks_written"] <= through["disk_blocks_written"]
    # Promotion: the tiered pool hits more than the MultiConnector's, which never
    # keeps what it loaded from the disk.
    assert through["pool_hit_rate"] > multi["pool_hit_rate"]


def test_written_around_the_pool_a_block_seen_once_reaches_the_disk_and_not_the_pool() -> None:
    # Each prompt's first block is shared; a block is saved in the pool once offered twice.
    trace = [blocks("ab"), blocks("ac"), blocks("ab"), blocks("ad")]
    refused = tiers.simulate_tiered(trace, 4, "lru", 2, "spill")
    around = tiers.simulate_tiered(trace, 4, "lru", 2, "spill", write_around=True)

    assert around["configuration"] == "tiered lru spill write_around"
    # Without it a refused block reaches no tier: "a" and "b" are computed twice each,
    # saved in the pool at their second sight.
    assert refused["disk_blocks_written"] == 0 and refused["computed_blocks"] == 6
    # With it, "a", "b", "c" and "d" go to the disk at first sight and are computed
    # once; the pool copies only the promoted "a" and "b".
    assert around["disk_blocks_written"] == 4
    assert around["computed_blocks"] == 4
    assert around["pool_blocks_copied"] == 2


def test_without_promotion_a_disk_hit_is_copied_into_no_pool_slot() -> None:
    # Two slots: "c" and "d" push "a" and "b" out to the disk; the last prompt reads them.
    trace = [blocks("ab"), blocks("cd"), blocks("ab")]
    promoting = tiers.simulate_tiered(trace, 2, "lru", 1, "spill")
    direct = tiers.simulate_tiered(trace, 2, "lru", 1, "spill", promotion="never")

    assert direct["configuration"] == "tiered lru spill promotion never"
    for row in (promoting, direct):
        assert row["disk_hit_rate"] == 2 / 6 and row["computed_blocks"] == 4
    assert promoting["pool_blocks_copied"] == 4 + 2
    assert direct["pool_blocks_copied"] == 4
