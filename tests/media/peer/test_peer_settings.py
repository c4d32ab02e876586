"""The peer medium's settings and profiles, checked without connecting to anything."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from kvwire import cli
from kvwire.blocks.format import BlockLayout
from kvwire.config.extra_config import ExtraConfigError
from kvwire.config.profile import load_profile
from kvwire.connectors.offload import OffloadConnector
from kvwire.media.base import MediumContext
from kvwire.media.peer import PeerMedium
from kvwire.media.peer._directory import Location, PeerRecord
from tests.support.connectors import read_options
from tests.support.peers import peer_config

CONTAINERS = pathlib.Path(__file__).resolve().parents[3] / "src" / "kvwire" / "profiles"
PROFILES = ("peer.yaml", "peer-prefill.yaml", "peer-decode.yaml")


def read(
    url: str = "redis://127.0.0.1:6379/0", key_prefix: str = "test:", **extra: object
) -> dict[str, object]:
    config = peer_config(url, key_prefix, **extra)
    assert config.kv_transfer_config is not None
    medium, options = read_options(OffloadConnector, config.kv_transfer_config)
    assert medium is PeerMedium
    return options


@pytest.mark.parametrize("name", PROFILES)
def test_kvwire_check_accepts_the_profile_without_connecting(name: str) -> None:
    # Port 6379 has no server in the tests: a check that connected would fail.
    assert cli.main(["check", str(CONTAINERS / name)]) == 0
    transfer = load_profile(CONTAINERS / name).kv_transfer_config
    assert transfer is not None
    assert transfer.kv_connector_extra_config["medium"] == "peer"


def test_the_prefill_and_decode_profiles_share_a_directory_and_differ_in_role() -> None:
    prefill = yaml.safe_load((CONTAINERS / "peer-prefill.yaml").read_text())["kv_transfer_config"]
    decode = yaml.safe_load((CONTAINERS / "peer-decode.yaml").read_text())["kv_transfer_config"]
    assert (prefill["kv_role"], decode["kv_role"]) == ("kv_producer", "kv_consumer")
    assert prefill["engine_id"] != decode["engine_id"]
    for key in ("url", "key_prefix"):
        assert prefill["kv_connector_extra_config"][key] == decode["kv_connector_extra_config"][key]


def test_a_cluster_url_is_accepted_as_the_directory_and_checked_as_the_redis_medium_does() -> None:
    settings = read(url="redis+cluster://127.0.0.1:7000,127.0.0.1:7001")["peer_directory_settings"]
    assert settings.is_cluster
    assert [seed.port for seed in settings.cluster_seeds] == [7000, 7001]
    # A cluster has only database 0, and a {hash tag} would put the whole
    # directory on one master: both refused, naming the key.
    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.url: .*database 0"):
        read(url="redis+cluster://127.0.0.1:7000/3")
    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.key_prefix: .*hash"):
        read(url="redis+cluster://127.0.0.1:7000", key_prefix="{job}:")


@pytest.mark.parametrize("name", ["has space", "", "x" * 201, "caf\u00e9"])
def test_a_bad_peer_name_is_refused_naming_the_key(name: str) -> None:
    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.peer_name: .*expected"):
        read(peer_name=name)


def test_a_bad_directory_setting_is_refused_naming_it() -> None:
    with pytest.raises(ExtraConfigError, match=r"socket_timeout_s"):
        read(socket_timeout_s=-1)
    with pytest.raises(ExtraConfigError, match=r"staging_blocks"):
        read(staging_blocks=0)


def test_the_redis_keys_that_size_values_are_not_the_peer_mediums() -> None:
    with pytest.raises(ExtraConfigError, match=r"ttl_seconds"):
        read(ttl_seconds=60)


def test_scheduler_and_worker_of_one_engine_agree_on_the_peer_name() -> None:
    config = peer_config("redis://127.0.0.1:6379/0", "test:")
    assert config.kv_transfer_config is not None
    engine_id = config.kv_transfer_config.engine_id
    _, options = read_options(OffloadConnector, config.kv_transfer_config)
    names = {
        PeerMedium(MediumContext("c", options, (), _layout(), engine_id=engine_id)).peer_name
        for _ in range(2)
    }
    assert names == {f"kvwire-{engine_id}"}


def _layout() -> BlockLayout:
    return BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")


@pytest.mark.parametrize("value", [b"", b"peer", b"peer 1", b"peer x 2", b"\xff 1 2", b"a b c d"])
def test_a_directory_value_no_peer_writes_names_no_location(value: bytes) -> None:
    assert Location.decode(value) is None


def test_locations_and_peer_records_round_trip() -> None:
    location = Location("kvwire-prefill-0", 17, 3)
    assert Location.decode(location.encode()) == location
    record = PeerRecord(b"agent", base_address=4096, entry_bytes=1024, num_slots=8)
    assert PeerRecord.decode(record.encode()) == record
    assert record.slot_address(2) == 4096 + 2 * 1024
    assert record.slot_address(8) is None and record.slot_address(-1) is None
    assert PeerRecord.decode(b"short") is None
