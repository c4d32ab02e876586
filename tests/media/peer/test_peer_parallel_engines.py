"""Split engines sharing KV peer to peer: TP=2 and PP=2 peers in processes of their own.

A producer split over two ranks runs in its own process for the module
(each rank a worker process with its own pool, NIXL agent and peer record);
each test's reader is an engine in the test's process. A reader split the
same way pulls each rank's share from the producer's matching rank; one
split otherwise finds nothing (the directory names the split) and computes.
Whatever happens, the reader's tokens are the unsplit model's without a
connector.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import pytest

from kvwire.engine.engine import GenerationRequest
from tests.media.peer.test_peer_engines import entries, read_as, reference
from tests.support.peers import BLOCK_SIZE, PeerProcess, peer_config, prompts
from tests.support.redis import RedisServer, distinct_prompt_blocks

pytestmark = pytest.mark.slow

SPLITS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"kvwire-test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="module", params=sorted(SPLITS))
def split(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def producer(redis_server: RedisServer, prefix: str, split: str) -> Iterator[PeerProcess]:
    # A slow heartbeat: a record a test removes stays removed for the test.
    peer = PeerProcess(
        url=redis_server.url,
        key_prefix=prefix,
        peer_name=f"{prefix}{split}",
        kv_role="kv_producer",
        peer_heartbeat_s=120,
        **SPLITS[split],
    )
    try:
        yield peer
    finally:
        peer.stop()


def produced(producer: PeerProcess, seed: int) -> list[GenerationRequest]:
    requests = prompts(seed=seed, num_requests=3)
    reply = producer.generate(requests)
    assert reply["stats"]["blocks_saved"] > 0
    return requests


def test_each_rank_pulls_its_share_from_the_producers_matching_rank(
    redis_server: RedisServer, prefix: str, split: str, producer: PeerProcess
) -> None:
    requests = produced(producer, seed=31)
    reader = peer_config(
        redis_server.url,
        prefix,
        kv_role="kv_consumer",
        peer_name=f"{prefix}reader",
        **SPLITS[split],
    )
    outputs, stats, _ = read_as(reader, requests)

    assert [o.output_token_ids for o in outputs] == reference(requests)
    # Every full prompt block came from the producer, each rank pulling its share.
    full = (len(requests[0].prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert outputs[0].external_tokens == full
    blocks = distinct_prompt_blocks(requests, BLOCK_SIZE)
    assert stats["peer_blocks_pulled"] == stats["blocks_loaded"] == 2 * blocks
    assert "load_errors" not in stats and "peer_stale_entries" not in stats
    # One directory entry per block, for both ranks; a record per rank.
    holders = [location.peer for location in entries(redis_server, prefix).values()]
    assert holders.count(f"{prefix}{split}") >= blocks
    records = {key.decode() for key in redis_server.client().scan_iter(f"{prefix}peer-agent/*")}
    assert records >= {f"{prefix}peer-agent/{prefix}{split} rank{r}" for r in (0, 1)}


def test_an_unsplit_reader_finds_nothing_of_a_split_producer_and_computes(
    redis_server: RedisServer, prefix: str, split: str, producer: PeerProcess
) -> None:
    requests = produced(producer, seed=32)
    reader = peer_config(
        redis_server.url, prefix, kv_role="kv_consumer", peer_name=f"{prefix}unsplit"
    )
    outputs, stats, _ = read_as(reader, requests)

    assert [o.output_token_ids for o in outputs] == reference(requests)
    assert sum(o.external_tokens for o in outputs) == 0
    assert "blocks_loaded" not in stats and "load_errors" not in stats


@pytest.mark.parametrize("split", ["tp2"], indirect=True)  # its own producer: once is enough
def test_a_split_reader_finds_nothing_of_an_unsplit_producer_and_computes(
    redis_server: RedisServer, prefix: str, split: str
) -> None:
    requests = prompts(seed=33, num_requests=3)
    unsplit = PeerProcess(
        url=redis_server.url, key_prefix=prefix, peer_name=f"{prefix}one", kv_role="kv_producer"
    )
    try:
        assert unsplit.generate(requests)["stats"]["blocks_saved"] > 0
        reader = peer_config(
            redis_server.url,
            prefix,
            kv_role="kv_consumer",
            peer_name=f"{prefix}reader",
            **SPLITS[split],
        )
        outputs, stats, _ = read_as(reader, requests)
    finally:
        unsplit.stop()

    assert [o.output_token_ids for o in outputs] == reference(requests)
    assert sum(o.external_tokens for o in outputs) == 0
    assert "blocks_loaded" not in stats and "load_errors" not in stats


# Each one-rank fault at one split (the ranks' faults do not depend on how they split).
@pytest.mark.parametrize("split", ["tp2"], indirect=True)
def test_a_pull_failed_on_one_rank_fails_the_block_on_every_rank(
    redis_server: RedisServer, prefix: str, split: str, producer: PeerProcess
) -> None:
    requests = produced(producer, seed=34)
    reader = peer_config(
        redis_server.url,
        prefix,
        kv_role="kv_consumer",
        peer_name=f"{prefix}reader",
        **SPLITS[split],
    )
    # The producer's rank 1 is gone for readers (its record expired, as a dead
    # rank's does); rank 0 is there and serves its share.
    client = redis_server.client()
    record = f"{prefix}peer-agent/{prefix}{split} rank1"
    value, expiry_ms = client.get(record), client.pttl(record)
    assert value is not None
    client.delete(record)
    try:
        outputs, stats, _ = read_as(reader, requests)
    finally:
        client.set(record, value, px=expiry_ms)  # for the module's other tests

    assert [o.output_token_ids for o in outputs] == reference(requests)
    assert all(o.error is None for o in outputs)
    # Rank 0 pulled its share, rank 1 could not: the blocks failed, computed again.
    # (Rank 1 withdrew the entries it could not read: rank 0 may find them gone.)
    assert stats["peer_blocks_pulled"] > 0
    assert stats["peer_read_failures"] > 0
    assert stats["load_errors"] == stats["peer_read_failures"] + stats.get("peer_lookup_misses", 0)
    assert sum(o.num_load_failures for o in outputs) > 0


@pytest.mark.parametrize("split", ["pp2"], indirect=True)
def test_a_rank_stalled_mid_read_costs_a_deadline_and_fails_the_block_on_every_rank(
    redis_server: RedisServer, prefix: str, split: str, producer: PeerProcess
) -> None:
    requests = produced(producer, seed=36)
    reader = peer_config(
        redis_server.url,
        prefix,
        kv_role="kv_consumer",
        peer_name=f"{prefix}reader",
        transfer_timeout_s=2,
        **SPLITS[split],
    )
    workers = producer.worker_pids()
    assert len(workers) == 2
    # One of the producer's ranks stops answering, its record still live; the other serves.
    os.kill(workers[0], signal.SIGSTOP)
    try:
        # The stopped rank resumes only after the read returned: it returns
        # at all only because each pull gave up at its deadline.
        outputs, stats, _ = read_as(reader, requests)
    finally:
        os.kill(workers[0], signal.SIGCONT)

    assert [o.output_token_ids for o in outputs] == reference(requests)
    assert all(o.error is None for o in outputs)
    assert stats["load_timeouts"] > 0
    assert stats["peer_blocks_pulled"] > 0
    assert sum(o.num_load_failures for o in outputs) > 0
