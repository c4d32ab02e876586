"""The tiered medium's options: every bad one named, with what is accepted, by `kvwire check`
and by the container alike."""

from __future__ import annotations

import io
import pathlib
from typing import Any

import pytest
import yaml

from kvwire.cli import check_profile
from kvwire.config.extra_config import ResolvedMedium, plugin_classes
from kvwire.media.store.directory.medium import DirectoryMedium
from kvwire.media.tiered.medium import TieredMedium
from kvwire.registry import default_registry
from tests.media.tiered.test_tiered_handler import RecordingMedium


def check(tmp_path: pathlib.Path, extra: dict[str, Any]) -> tuple[int, str]:
    profile = tmp_path / "tiered.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "kv_transfer_config": {
                    "kv_connector": "TieredOffloadConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_pool_bytes": "1MiB", **extra},
                }
            }
        )
    )
    out, err = io.StringIO(), io.StringIO()
    status = check_profile(str(profile), out=out, err=err)
    return status, out.getvalue() + err.getvalue()


def test_a_valid_profile_checks(tmp_path: pathlib.Path) -> None:
    tiers = [{"medium": "directory", "shared_storage_path": str(tmp_path / "s")}]
    status, text = check(tmp_path, {"tiers": tiers, "write_policy": "spill", "eviction": "arc"})
    assert status == 0, text


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, "kv_connector_extra_config.tiers is required by TieredOffloadConnector"),
        ({"tiers": []}, "kv_connector_extra_config.tiers: [] is not accepted"),
        ({"tiers": ["directory"]}, "each with 'medium'"),
        ({"tiers": [{"medium": "tiered"}]}, "a medium's name other than 'tiered'"),
        (
            {
                "tiers": [{"medium": "directory", "shared_storage_path": "/tmp/x"}],
                "write_policy": 1,
            },
            "kv_connector_extra_config.write_policy: 1 is not accepted by TieredOffloadConnector; "
            "expected 'write_through' or 'spill'",
        ),
    ],
)
def test_a_bad_option_is_named_with_what_is_accepted(
    tmp_path: pathlib.Path, extra: dict[str, Any], expected: str
) -> None:
    status, text = check(tmp_path, extra)
    assert status == 1
    assert expected in text


def test_every_bad_tier_is_named_by_its_position_at_once(tmp_path: pathlib.Path) -> None:
    tiers = [
        {"medium": "directory", "shared_storage_path": "/tmp/x", "fsink": True},
        {"medium": "nosuch"},
        {"medium": "redis", "url": "http://x"},
    ]
    status, text = check(tmp_path, {"tiers": tiers})
    assert status == 1
    assert (
        "kv_connector_extra_config.tiers[0].fsink is not an option of tiers[0] (directory)" in text
    )
    assert "kv_connector_extra_config.tiers[1].medium: unknown medium 'nosuch'" in text
    assert "kv_connector_extra_config.tiers[2].url: scheme must be one of redis://" in text


def test_a_cpu_pool_is_refused_as_a_tier_with_what_to_do_instead(tmp_path: pathlib.Path) -> None:
    status, text = check(tmp_path, {"tiers": [{"medium": "cpu_pool"}]})
    assert status == 1
    assert "kv_connector_extra_config.tiers[0].medium: 'cpu_pool' is a CPU pool" in text
    assert "expected a slower medium, such as directory or redis" in text
    assert "cpu_pool_bytes" in text


def test_a_medium_that_places_its_blocks_is_refused_as_a_tier(tmp_path: pathlib.Path) -> None:
    tiers = [{"medium": "peer", "url": "redis://127.0.0.1:6379/0", "cpu_pool_bytes": "1MiB"}]
    status, text = check(tmp_path, {"tiers": tiers})
    assert status == 1
    assert (
        "kv_connector_extra_config.tiers[0].medium: 'peer' places its blocks itself "
        "(found_by_key is False), so it cannot be a secondary tier" in text
    )


def test_a_tier_resolves_to_its_class_options_and_plugins() -> None:
    options = {"tiers": ({"medium": "directory", "shared_storage_path": "/tmp/x"},)}
    keys = [key for key in TieredMedium.extra_config_keys() if key.name == "tiers"]
    (tier,) = plugin_classes(keys, options, default_registry())["tiers"]
    assert isinstance(tier, ResolvedMedium)
    assert tier.medium_class is DirectoryMedium
    assert tier.options["shared_storage_path"] == "/tmp/x"
    assert "/tmp/x" not in repr(tier)  # options may hold secrets: never in a repr


def test_a_medium_built_by_hand_without_its_resolved_tiers_says_how_to_pass_them() -> None:
    from kvwire.blocks.format import BlockLayout
    from kvwire.blocks.groups import CacheGroup
    from kvwire.media.base import MediumContext

    layout = BlockLayout(num_layers=1, block_size=4, num_kv_heads=1, head_size=8, dtype="float32")
    context = MediumContext(
        connector_name="TieredOffloadConnector",
        options={"cpu_pool_bytes": 1 << 20},
        groups=(CacheGroup(0, ("layers.0",), 4),),
        layout=layout,
    )
    with pytest.raises(ValueError, match=r"MediumContext\.plugins has no 'tiers'"):
        TieredMedium(context)


def test_a_long_medium_path_is_shown_bounded_in_every_message(tmp_path: pathlib.Path) -> None:
    path = "kvwire.media.store.directory.medium:DirectoryMedium"
    tier = {"medium": "x" * 10_000, "shared_storage_path": "/tmp/x"}
    status, text = check(tmp_path, {"tiers": [tier]})
    assert status == 1
    assert "x" * 200 not in text
    status, text = check(tmp_path, {"tiers": [{"medium": path, "fsink": True}]})
    assert status == 1
    assert f"tiers[0] ({path})" in text


def test_promotion_is_always_or_never(tmp_path: pathlib.Path) -> None:
    tiers = [{"medium": "directory", "shared_storage_path": str(tmp_path / "s")}]
    for promotion in ("always", "never"):
        status, text = check(tmp_path, {"tiers": tiers, "promotion": promotion})
        assert status == 0, text
    status, text = check(tmp_path, {"tiers": tiers, "promotion": "sometimes"})
    assert status == 1
    assert (
        "kv_connector_extra_config.promotion: 'sometimes' is not accepted by "
        "TieredOffloadConnector; expected 'always' or 'never'" in text
    )
    status, text = check(tmp_path, {"tiers": tiers, "write_around": "yes"})
    assert status == 1
    assert (
        "kv_connector_extra_config.write_around: 'yes' is not accepted by "
        "TieredOffloadConnector; expected true or false" in text
    )


def test_reading_tier_blocks_straight_into_the_cache_needs_a_tier_deadline(
    tmp_path: pathlib.Path,
) -> None:
    tiers = [
        {"medium": "directory", "shared_storage_path": str(tmp_path / "s")},
        # A medium found by key with no keys at all: no transfer_timeout_s.
        {"medium": f"{RecordingMedium.__module__}:RecordingMedium"},
    ]
    status, text = check(tmp_path, {"tiers": tiers, "promotion": "always"})
    assert status == 0, text
    for extra in ({"promotion": "never"}, {"write_around": True}):
        status, text = check(tmp_path, {"tiers": tiers, **extra})
        assert status == 1
    assert (
        "kv_connector_extra_config.tiers[1].medium: 'tests.media.tiered.test_tiered_handler:"
        "RecordingMedium' has no transfer_timeout_s, which promotion: never and "
        "write_around need" in text
    )
