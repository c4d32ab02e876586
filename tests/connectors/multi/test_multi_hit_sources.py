"""MultiConnector: a request's external hit is attributed to the tiers of the child loading it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvwire.connectors.multi import MultiConnector
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import CacheHitSource, KVCacheBlocks, Request
from kvwire.testing import IdleConnector
from tests.support.pairs import build_multi, make_request

BLOCK = 4
PROMPT = list(range(100, 117))


class TierConnector(IdleConnector):
    """A child holding ``hits`` tokens (by request id) in the tier its extra config names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = self._kv_transfer_config.kv_connector_extra_config
        self._cache_hit_source = CacheHitSource(options["tier"])
        self.hits: dict[str, int] = options.get("hits", {})

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.hits.get(request.request_id, 0), False


class SplitTierConnector(TierConnector):
    """A child whose hit lies half in host memory, half on disk."""

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        half = num_external_tokens // 2
        return {CacheHitSource.HOST: half, CacheHitSource.DISK: num_external_tokens - half}


def tier(kind: str, hits: dict[str, int], connector: str = "TierConnector") -> dict[str, Any]:
    return {
        "kv_connector": connector,
        "kv_connector_module_path": __name__,
        "kv_connector_extra_config": {"tier": kind, "hits": hits},
    }


def scheduler_side(*children: dict[str, Any]) -> MultiConnector:
    return build_multi(KVConnectorRole.SCHEDULER, {"connectors": list(children)})


def admit(multi: MultiConnector, request: Request) -> int:
    """Look the request up and allocate for all of its hit, as the scheduler does."""
    tokens, _ = multi.get_num_new_matched_tokens(request, 0)
    assert tokens is not None
    multi.update_state_after_alloc(request, KVCacheBlocks(block_ids=([0, 1, 2, 3],)), tokens)
    return tokens


def test_the_hit_is_attributed_to_the_tier_of_the_child_that_loads_it() -> None:
    multi = scheduler_side(tier("host", {}), tier("disk", {"a": 16}))
    request = make_request("a", PROMPT, BLOCK)

    tokens = admit(multi, request)

    assert multi.get_external_cache_hit_sources(request, tokens) == {CacheHitSource.DISK: 16}


def test_each_request_is_attributed_to_its_own_loading_child() -> None:
    multi = scheduler_side(tier("host", {"a": 8}), tier("disk", {"a": 16, "b": 12}))
    first, second = make_request("a", PROMPT, BLOCK), make_request("b", PROMPT, BLOCK)

    admit(multi, first)
    admit(multi, second)

    assert multi.get_external_cache_hit_sources(first, 8) == {CacheHitSource.HOST: 8}
    assert multi.get_external_cache_hit_sources(second, 12) == {CacheHitSource.DISK: 12}


def test_a_loading_child_that_splits_its_hit_across_tiers_is_asked() -> None:
    multi = scheduler_side(tier("host", {"a": 16}, connector="SplitTierConnector"))
    request = make_request("a", PROMPT, BLOCK)

    tokens = admit(multi, request)

    assert multi.get_external_cache_hit_sources(request, tokens) == {
        CacheHitSource.HOST: 8,
        CacheHitSource.DISK: 8,
    }


@pytest.mark.parametrize(
    "finish",
    [
        lambda multi, request: multi.request_finished(request, [0, 1, 2, 3]),
        lambda multi, request: multi.request_finished_all_groups(request, ([0, 1, 2, 3],)),
    ],
    ids=["request_finished", "request_finished_all_groups"],
)
def test_a_finished_request_s_loading_child_is_forgotten(
    finish: Callable[[MultiConnector, Request], object],
) -> None:
    multi = scheduler_side(tier("disk", {"a": 16}))
    request = make_request("a", PROMPT, BLOCK)
    admit(multi, request)

    finish(multi, request)

    # The request id is free again: what a request with that id would load is unknown.
    assert multi.get_external_cache_hit_sources(request, 16) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 16
    }
