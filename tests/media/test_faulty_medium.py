"""The fault-injecting medium: another medium whose chosen loads fail, as a failing medium's would.

Its handler leaves 0xFF bytes (NaN) in the chosen block of every layer of
the block's group once the wrapped loads ended, and reports that block as a
load error; the engine recomputes it, so outputs stay those of a run
without a connector.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Mapping, Sequence, Set

import attrs
import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config.extra_config import ExtraConfigKey, bool_key
from kvwire.connectors.offload import OffloadConnector
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash
from kvwire.media.base import (
    JobResult,
    Medium,
    MediumContext,
    MediumIndex,
    TransferHandler,
    TransferJob,
)
from kvwire.media.store.directory import DirectoryMedium
from kvwire.testing.faulty_medium import FaultInjectingHandler, FaultInjectingMedium
from tests.support.engines import generate, tiny_config, tokens
from tests.support.media import (
    DrivenHandler,
    FailEveryFirstBlock,
    FailEverySecondBlock,
    over_medium,
    shared_storage,
)

NUM_BLOCKS = 10
LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
# A hybrid engine's two groups: full attention, and a sliding window.
GROUPS = (
    CacheGroup(0, ("layers.0.attn", "layers.2.attn"), 4),
    CacheGroup(1, ("layers.1.attn", "layers.3.attn"), 4, sliding_window=8),
)
LOADED = 1.0  # what the stub medium writes into the blocks it loads


class StubIndex(MediumIndex):
    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        return len(block_hashes)


class StubHandler(TransferHandler):
    """Loads end when waited for (writing :data:`LOADED`), or once ``finished`` names them."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.running: dict[int, TransferJob] = {}
        self.ended: list[JobResult] = []
        self.finished: set[str] = set()

    def submit(self, job: TransferJob) -> None:
        self.running[job.job_id] = job

    def poll(self) -> list[JobResult]:
        for job_id, job in list(self.running.items()):
            if {transfer.request_id for transfer in job.transfers} <= self.finished:
                self._end(job_id)
        ended, self.ended = self.ended, []
        return ended

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        for job_id in job_ids:
            if job_id in self.running:
                self._end(job_id)
        return True

    def _end(self, job_id: int) -> None:
        job = self.running.pop(job_id)
        for transfer in job.transfers:
            for name in GROUPS[transfer.group].layer_names:
                self.kv_caches[name][:, list(transfer.block_ids)] = LOADED
        self.ended.append(JobResult(job_id))

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        return []

    def close(self) -> None:
        pass


class StubMedium(Medium):
    event_medium = "stub"

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return (bool_key("stub_flag", False),)

    @property
    def group_layouts(self) -> tuple[BlockLayout, ...]:
        return tuple(attrs.evolve(LAYOUT, group=f"stub-{group.index}") for group in GROUPS)

    def build_index(self) -> MediumIndex:
        return StubIndex()

    def build_handler(
        self, kv_caches: Mapping[str, torch.Tensor], counters: Counters
    ) -> TransferHandler:
        return StubHandler(kv_caches)


class FailRsFirstBlock(FaultInjectingMedium):
    inner = StubMedium
    fail_request_ids = frozenset({"r"})
    fail_block_index = 0


class FailEveryLastBlock(FaultInjectingMedium):
    inner = StubMedium


class FailEveryBlockPastTheEnd(FaultInjectingMedium):
    inner = StubMedium
    fail_block_index = 99


def _caches() -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros(2, NUM_BLOCKS, 4, 2, 8) for group in GROUPS for name in group.layer_names
    }


def _handler(
    medium_class: type[FaultInjectingMedium], caches: dict[str, torch.Tensor]
) -> DrivenHandler[FaultInjectingHandler]:
    medium = medium_class(MediumContext("TestConnector", {}, GROUPS, LAYOUT))
    return DrivenHandler(medium.build_handler(caches, Counters()))


def _load(request_id: str, group: int, *block_ids: int) -> BlockTransfer:
    return BlockTransfer(
        request_id=request_id,
        block_ids=block_ids,
        block_hashes=tuple(BlockHash(bytes([b])) for b in block_ids),
        group=group,
    )


def _nan_blocks(caches: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Per layer, the blocks every value of which is NaN."""
    return {
        name: [b for b in range(NUM_BLOCKS) if bool(cache[:, b].isnan().all())]
        for name, cache in caches.items()
    }


def test_a_chosen_synchronous_load_leaves_nan_in_its_block_once_the_wrapped_loads_ended() -> None:
    caches = _caches()
    handler = _handler(FailRsFirstBlock, caches)
    # The sliding group's transfer first: the range is still full group, then sliding.
    handler.start_loads([_load("r", 1, 7, 8), _load("r", 0, 3, 4, 5), _load("s", 0, 6)], [])
    assert handler.load_errors_so_far() == set()
    handler.wait_for_loads()
    # Block 3 of both full-attention layers; what the load wrote elsewhere stays.
    assert _nan_blocks(caches) == {
        "layers.0.attn": [3],
        "layers.2.attn": [3],
        "layers.1.attn": [],
        "layers.3.attn": [],
    }
    assert bool((caches["layers.0.attn"][:, [4, 5, 6]] == LOADED).all())
    assert handler.load_errors_so_far() == {3}
    assert handler.take_load_errors() == {3}
    assert handler.take_load_errors() == set()


def test_only_a_chosen_requests_first_load_fails() -> None:
    caches = _caches()
    handler = _handler(FailRsFirstBlock, caches)
    handler.start_loads([_load("s", 0, 1, 2)], [])
    handler.wait_for_loads()
    handler.start_loads([_load("r", 0, 3)], [])
    handler.wait_for_loads()
    handler.start_loads([_load("r", 0, 4)], [])
    handler.wait_for_loads()
    assert handler.take_load_errors() == {3}
    assert _nan_blocks(caches)["layers.0.attn"] == [3]


@pytest.mark.parametrize("medium_class", [FailEveryLastBlock, FailEveryBlockPastTheEnd])
def test_an_index_from_the_end_or_past_it_picks_the_last_groups_last_block(
    medium_class: type[FaultInjectingMedium],
) -> None:
    caches = _caches()
    handler = _handler(medium_class, caches)
    handler.start_loads([_load("r", 1, 7, 8), _load("r", 0, 3, 4, 5)], [])
    handler.wait_for_loads()
    assert handler.take_load_errors() == {8}
    assert _nan_blocks(caches) == {
        "layers.0.attn": [],
        "layers.2.attn": [],
        "layers.1.attn": [8],
        "layers.3.attn": [8],
    }


def test_a_chosen_asynchronous_load_fails_when_reported_finished() -> None:
    caches = _caches()
    handler = _handler(FailRsFirstBlock, caches)
    inner = handler.handler.inner
    assert isinstance(inner, StubHandler)
    handler.start_loads([], [_load("r", 0, 2, 3)])
    assert handler.take_finished_loads() == set()
    assert handler.take_load_errors() == set()
    assert _nan_blocks(caches)["layers.0.attn"] == []
    inner.finished.add("r")
    assert handler.take_finished_loads() == {"r"}
    assert _nan_blocks(caches)["layers.0.attn"] == [2]
    assert handler.take_load_errors() == {2}


def test_keys_events_layouts_and_index_are_the_wrapped_mediums() -> None:
    medium = FailRsFirstBlock(MediumContext("TestConnector", {}, GROUPS, LAYOUT))
    assert [key.name for key in FailRsFirstBlock.extra_config_keys()] == ["stub_flag"]
    assert FailRsFirstBlock.event_medium == "stub"
    assert [layout.group for layout in medium.group_layouts] == ["stub-0", "stub-1"]
    assert isinstance(medium.build_index(), StubIndex)


def test_a_subclass_configured_wrong_is_refused_naming_the_attribute() -> None:
    with pytest.raises(TypeError, match=r"BadInner\.inner: expected a class deriving from"):

        class BadInner(FaultInjectingMedium):
            inner = object  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"BadIds\.fail_request_ids: expected a frozenset"):

        class BadIds(FaultInjectingMedium):
            inner = StubMedium
            fail_request_ids = {"r"}  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"FaultInjectingMedium\.inner is not set"):
        FaultInjectingMedium.extra_config_keys()


def _workload() -> list[GenerationRequest]:
    prefix = tuple(range(100, 120))
    return [
        GenerationRequest("first", (*prefix, 1, 2, 3), max_tokens=4),
        GenerationRequest("second", (*prefix, 4, 5, 6, 7, 8, 9, 10), max_tokens=4),
    ]


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_an_engine_over_the_faulty_medium_recomputes_the_failed_blocks_and_outputs_stay_equal(
    tmp_path: pathlib.Path, async_load: bool
) -> None:
    config = tiny_config()
    reference = tokens(generate(config, _workload()))
    connector_config = shared_storage(config, tmp_path, async_load=async_load)
    generate(connector_config, _workload())  # fills the store
    with LLMEngine(
        connector_config, container=over_medium(connector_config, FailEverySecondBlock)
    ) as engine:
        connector = engine.worker_connector
        assert isinstance(connector, OffloadConnector)
        assert isinstance(connector.medium, FailEverySecondBlock)
        assert isinstance(connector.medium.inner_medium, DirectoryMedium)
        warm = engine.generate(_workload())
    assert tokens(warm) == reference
    assert [output.num_load_failures for output in warm] == [1, 1]


@pytest.mark.slow
def test_a_profile_names_the_faulty_medium_for_a_worker_process(tmp_path: pathlib.Path) -> None:
    config = tiny_config()
    reference = tokens(generate(config, _workload()))
    generate(shared_storage(config, tmp_path), _workload())  # fills the store
    faulty = shared_storage(
        config, tmp_path, medium=f"{FailEveryFirstBlock.__module__}:FailEveryFirstBlock"
    )
    warm = generate(faulty, _workload(), worker_mode="process")
    assert tokens(warm) == reference
    assert [output.num_load_failures for output in warm] == [1, 1]
