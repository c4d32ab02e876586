"""The peer medium's directory on a hung server (SIGSTOP: connections open, nothing answers).

Every directory call of the scheduler side waits at most ``lookup_timeout_s``
(1 s), never ``socket_timeout_s`` (10 s here): the first call to the hung
server costs that deadline, the rest answer at once. Eight requests' calls,
which would take 80 s at a socket timeout each, end within 5 s. Once the
server answers again the probe finds it, lookups hit again, and the
announcements and withdrawals the holder could not make are made at its
first step. On a real redis-server of the tests' own, stopped and continued.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvwire.blocks.format import BlockLayout
from kvwire.media.peer._directory import PeerDirectory
from kvwire.media.peer._index import PeerIndex
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.redis import RedisServer
from tests.support.waits import finishes_within, wait_until

# Each waits out a real deadline (lookup_timeout_s) on a stopped server.
pytestmark = pytest.mark.slow

LAYOUT = BlockLayout(num_layers=1, block_size=2, num_kv_heads=1, head_size=4, dtype="float32")
REQUESTS = 8
SOCKET_TIMEOUT_S = 10.0
# Far below a socket timeout per request (80 s), far above one lookup_timeout_s (1 s).
BOUND_S = 5.0
BLOCKS = [bytes([n]) * 32 for n in range(3)]


@pytest.fixture
def directories(fault_server: RedisServer, key_prefix: str) -> Iterator[list[PeerDirectory]]:
    """A holder's directory and a reader's, on the server the test may stop."""
    settings = RedisStoreSettings.from_extra_config(
        {
            "url": fault_server.url,
            "key_prefix": key_prefix,
            "socket_timeout_s": SOCKET_TIMEOUT_S,
            "connect_timeout_s": SOCKET_TIMEOUT_S,
            "retry_interval_s": 0.05,
        }
    )
    made = [PeerDirectory(settings, 60.0) for _ in range(2)]
    yield made
    for directory in made:
        directory.close()


def peer_index(directory: PeerDirectory, peer: str, num_slots: int = 4) -> PeerIndex:
    return PeerIndex(
        num_slots=num_slots,
        fingerprints=[LAYOUT.fingerprint_hex],
        medium="peer",
        peer=peer,
        directory=directory,
    )


def store(index: PeerIndex, blocks: list[bytes]) -> None:
    """Blocks saved into ``index``'s pool, announced as a save's completion does."""
    assert len(index.prepare_save(0, blocks)) == len(blocks)
    index.complete_save(0, blocks, success=True)


def found_by(reader: PeerIndex, blocks: list[bytes]) -> list[bool]:
    return [reader.count_held_prefix(0, [block]) == 1 for block in blocks]


def test_a_readers_lookups_on_a_hung_directory_wait_one_deadline_then_miss_at_once(
    fault_server: RedisServer, directories: list[PeerDirectory]
) -> None:
    holder_directory, reader_directory = directories
    store(peer_index(holder_directory, "holder"), BLOCKS)
    reader = peer_index(reader_directory, "reader")
    assert reader.count_held_prefix(0, BLOCKS) == len(BLOCKS)  # connected, and found

    with fault_server.paused():
        counts = finishes_within(
            BOUND_S, lambda: [reader.count_held_prefix(0, BLOCKS) for _ in range(REQUESTS)]
        )
        assert not reader_directory.is_available

    assert counts == [0] * REQUESTS
    # Every call not made is counted: the one given up on and the seven skipped.
    assert reader.take_counters()["peer_directory_failures"] == REQUESTS


def test_once_the_hung_directory_answers_again_the_probe_finds_it_and_hits_resume(
    fault_server: RedisServer, directories: list[PeerDirectory]
) -> None:
    holder_directory, reader_directory = directories
    store(peer_index(holder_directory, "holder"), BLOCKS)
    reader = peer_index(reader_directory, "reader")

    with fault_server.paused():
        assert finishes_within(BOUND_S, lambda: reader.count_held_prefix(0, BLOCKS)) == 0
    wait_until(lambda: reader_directory.is_available, "the probe to find the directory back")

    assert reader.count_held_prefix(0, BLOCKS) == len(BLOCKS)


def test_a_holders_announcements_and_withdrawals_on_a_hung_directory_are_made_once_it_is_back(
    fault_server: RedisServer, directories: list[PeerDirectory]
) -> None:
    holder_directory, reader_directory = directories
    holder = peer_index(holder_directory, "holder", num_slots=REQUESTS)
    reader = peer_index(reader_directory, "reader")
    old = [bytes([1, n]) * 16 for n in range(REQUESTS)]
    new = [bytes([2, n]) * 16 for n in range(REQUESTS)]
    store(holder, old)
    assert found_by(reader, old) == [True] * REQUESTS

    def requests() -> None:
        # Each request's save evicts an old block (a withdrawal) and announces
        # its own; each scheduler step takes the counters.
        for block in new:
            store(holder, [block])
            holder.take_counters()

    with fault_server.paused():
        finishes_within(BOUND_S, requests)
    wait_until(lambda: holder_directory.is_available, "the probe to find the directory back")
    holder.take_counters()  # the holder's first step with the directory back

    assert found_by(reader, new) == [True] * REQUESTS
    # No entry is left naming a slot the pool has reused since.
    assert found_by(reader, old) == [False] * REQUESTS


def test_withdrawals_past_the_backlog_are_dropped_oldest_first_and_counted(
    fault_server: RedisServer, directories: list[PeerDirectory]
) -> None:
    holder_directory, reader_directory = directories
    holder = PeerIndex(
        num_slots=4,
        fingerprints=[LAYOUT.fingerprint_hex],
        medium="peer",
        peer="holder",
        directory=holder_directory,
        withdrawal_backlog=2,
    )
    reader = peer_index(reader_directory, "reader")
    old = [bytes([1, n]) * 16 for n in range(4)]
    store(holder, old)

    with fault_server.paused():
        # Four saves, each evicting an old block: one request's blocks go last one first.
        finishes_within(BOUND_S, lambda: [store(holder, [bytes([2, n]) * 16]) for n in range(4)])
    wait_until(lambda: holder_directory.is_available, "the probe to find the directory back")
    counters = holder.take_counters()  # the first step with the directory back

    assert counters["peer_withdrawals_dropped"] == 2
    # The two oldest withdrawals (of old[3], then old[2]) were dropped: those
    # entries stay until they expire (a reader refuses what it pulls from
    # them); the others went. The oldest was sent first, given up on at its
    # deadline, and may have been made once the server answered again.
    assert found_by(reader, old)[:3] == [False, False, True]


def test_a_hung_directory_is_warned_about_once_by_its_server_without_the_password(
    fault_server: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    address = f"{fault_server.host}:{fault_server.port}"
    settings = RedisStoreSettings.from_extra_config(
        {
            "url": f"redis://kv:directory-secret@{address}/0",
            "key_prefix": key_prefix,
            "socket_timeout_s": SOCKET_TIMEOUT_S,
            "retry_interval_s": 3600,
        }
    )
    directory = PeerDirectory(settings, 60.0)
    key = directory.entry_key(LAYOUT.fingerprint_hex, BLOCKS[0])
    try:
        logged = caplog.at_level(logging.WARNING, logger="kvwire.media.peer._directory")
        with logged, fault_server.paused():
            finishes_within(BOUND_S, lambda: [directory.look_up([key]) for _ in range(REQUESTS)])
    finally:
        directory.close()

    (warning,) = [record.getMessage() for record in caplog.records]
    assert warning.startswith(f"peer directory at redis://kv:***@{address}/0 is unavailable")
    assert "lookup_timeout_s=1s" in warning
    assert "directory-secret" not in caplog.text
