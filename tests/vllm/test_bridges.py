"""The translations between vLLM and kvwire, one at a time, without an engine."""

from __future__ import annotations

import math
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from dependency_injector import containers
from vllm.v1.core.sched.output import CachedRequestData
from vllm.v1.request import RequestStatus as VLLMRequestStatus

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.paged_cache import PagedKVCaches
from kvwire.interface.types import BlockRemoved, BlockStored
from kvwire.ranks import EveryRank
from kvwire.vllm.config_bridge import (
    VLLMConfigError,
    _cache_dtype,
    container_hook,
    kv_cache_config_from_vllm,
    kv_dtype_name,
    parallel_config_from_vllm,
    read_kvwire_profile,
    run_container_hook,
)
from kvwire.vllm.engine_calls import wait_for_saves
from kvwire.vllm.events import BlockTokens
from kvwire.vllm.scheduler_bridge import AllocationFilter, BlockTables, RequestView
from kvwire.vllm.stats import KVWireStats, metric_name

PROFILE = {"kv_transfer_config": {"kv_connector": "CPUOffloadConnector", "kv_role": "kv_both"}}


def scheduler_output(new: list[Any], cached: CachedRequestData, **fields: Any) -> Any:
    scheduled = {request.req_id: 32 for request in new} | dict.fromkeys(cached.req_ids, 1)
    return types.SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        finished_req_ids=fields.get("finished", set()),
        preempted_req_ids=fields.get("preempted"),
    )


def cached_requests(
    ids: list[str], new_block_ids: list[Any], resumed: frozenset[str] = frozenset()
) -> Any:
    return CachedRequestData(
        req_ids=ids,
        resumed_req_ids=set(resumed),
        new_token_ids=[[] for _ in ids],
        all_token_ids={},
        new_block_ids=new_block_ids,
        num_computed_tokens=[64 for _ in ids],
        num_output_tokens=[0 for _ in ids],
    )


def new_request(request_id: str, block_ids: list[int]) -> Any:
    return types.SimpleNamespace(req_id=request_id, block_ids=(block_ids,), num_computed_tokens=0)


def test_extra_config_key_kvwire_does_not_know_is_an_error_naming_it() -> None:
    with pytest.raises(VLLMConfigError, match="'kvwire_profil'"):
        read_kvwire_profile({"kvwire_profil": "cpu-offload"})


def test_profile_given_both_as_path_and_inline_is_an_error() -> None:
    with pytest.raises(VLLMConfigError, match="not both"):
        read_kvwire_profile({"kvwire_profile": "x.yaml", "kvwire": PROFILE})


def test_inline_profile_is_validated_like_a_yaml_one() -> None:
    with pytest.raises(ValueError, match=r"kv_transfer_config\.kv_rol"):
        read_kvwire_profile({"kvwire": {"kv_transfer_config": {"kv_rol": "kv_both"}}})


def test_container_hook_must_name_module_and_function() -> None:
    with pytest.raises(VLLMConfigError, match="kvwire_container_hook"):
        container_hook({"kvwire_container_hook": "tests.support.vllm.never_hit"})
    assert container_hook({"kvwire_container_hook": "tests.support.vllm:never_hit"}) is not None


def test_unknown_extra_config_keys_of_any_type_and_length_are_listed_bounded() -> None:
    extra = {1: "a", ("x",): "b", "k" * 100_000: "c", **{f"key{i}": i for i in range(10)}}
    with pytest.raises(VLLMConfigError, match=r"unknown key\(s\) .* and 8 more; ") as raised:
        read_kvwire_profile(extra)
    assert len(str(raised.value)) < 1000


@pytest.mark.parametrize("spec", [":hook", "..relative:hook", "mod\0ule:hook", "module:not-a-name"])
def test_container_hook_that_is_not_dotted_names_is_an_error_naming_the_key(spec: str) -> None:
    with pytest.raises(VLLMConfigError, match=r"kvwire_container_hook: expected 'package\.module"):
        container_hook({"kvwire_container_hook": spec})


def test_container_hook_spec_is_shown_bounded() -> None:
    with pytest.raises(VLLMConfigError, match="kvwire_container_hook") as raised:
        container_hook({"kvwire_container_hook": "m" * 100_000})
    assert len(str(raised.value)) < 1000


def failing_hook(container: Any) -> None:
    raise RuntimeError("no such provider")


def test_container_hook_that_raises_is_an_error_naming_the_key_and_the_hook() -> None:
    with pytest.raises(VLLMConfigError, match=r"kvwire_container_hook: .*failing_hook raised Runt"):
        run_container_hook(failing_hook, containers.DynamicContainer())


def test_container_hook_whose_module_raises_at_import_is_an_error_naming_the_key() -> None:
    with pytest.raises(VLLMConfigError) as raised:
        container_hook({"kvwire_container_hook": "tests.support.plugin_modules.raising_hook:hook"})
    message = str(raised.value)
    assert message.startswith(
        "kv_transfer_config.kv_connector_extra_config.kvwire_container_hook: cannot import "
        "'tests.support.plugin_modules.raising_hook': RuntimeError: hook settings from redis://u:***@h"
    ), message
    assert "hunter2" not in message
    # Nothing chained: a traceback printed later would quote the module's message raw.
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_container_hook_whose_module_calls_sys_exit_is_an_error_naming_the_key() -> None:
    with pytest.raises(VLLMConfigError) as raised:
        container_hook({"kvwire_container_hook": "tests.support.plugin_modules.exiting:hook"})
    message = str(raised.value)
    assert message.startswith(
        "kv_transfer_config.kv_connector_extra_config.kvwire_container_hook: cannot import "
        "'tests.support.plugin_modules.exiting': SystemExit: plugin settings from redis://u:***@h"
    ), message
    assert "hunter2" not in message


@pytest.mark.slow
def test_container_hook_whose_module_raises_keyboard_interrupt_is_an_error_naming_the_key() -> None:
    # In a subprocess: a KeyboardInterrupt that escaped would stop this test session.
    code = (
        "from kvwire.vllm.config_bridge import container_hook\n"
        "try:\n"
        "    container_hook(\n"
        "        {'kvwire_container_hook': 'tests.support.plugin_modules.interrupting:hook'}\n"
        "    )\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.startswith(
        "VLLMConfigError kv_transfer_config.kv_connector_extra_config.kvwire_container_hook: "
        "cannot import 'tests.support.plugin_modules.interrupting': KeyboardInterrupt: "
        "plugin gave up on redis://u:***@h"
    ), result.stdout + result.stderr


def exiting_hook(container: Any) -> None:
    raise SystemExit("no such provider")


def test_container_hook_that_calls_sys_exit_is_an_error_naming_the_hook() -> None:
    with pytest.raises(VLLMConfigError, match=r"exiting_hook raised SystemExit: no such provider"):
        run_container_hook(exiting_hook, containers.DynamicContainer())


@pytest.mark.parametrize("timeout_s", [0, -1.0, math.nan, math.inf, "5", True, None])
def test_wait_for_saves_refuses_a_timeout_that_is_not_finite_seconds(timeout_s: Any) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
        wait_for_saves(object(), timeout_s)


def test_vllm_kv_cache_tensors_become_kvwire_tensors_with_sizes_and_layers() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    names = ["layers.0.attn", "layers.1.attn"]
    vllm_config = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[
            KVCacheTensor(
                size=spec.page_size_bytes * 10,
                layers=[name],
                layer_stride=0,
                block_stride=spec.page_size_bytes,
            )
            for name in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
    )
    config = kv_cache_config_from_vllm(vllm_config)
    assert [tensor.shared_by for tensor in config.kv_cache_tensors] == [[name] for name in names]
    assert config.kv_cache_tensors[0].size_bytes == spec.page_size_bytes * 10
    assert config.kv_cache_groups[0].kv_cache_spec.page_size_bytes == spec.page_size_bytes


def test_torch_float8_dtype_gets_kvwire_name_and_unknown_dtype_is_refused() -> None:
    assert kv_dtype_name(torch.float8_e4m3fn, "model_config.dtype") == "float8_e4m3fn"
    with pytest.raises(
        VLLMConfigError,
        match=r"^vLLM's cache_config\.cache_dtype is 'int8', a KV cache dtype kvwire does not "
        r"move; accepted: .*float32",
    ):
        kv_dtype_name(torch.int8, "cache_config.cache_dtype")


def test_an_unknown_cache_dtype_names_vllm_s_field() -> None:
    vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(cache_dtype="int4"),
        model_config=types.SimpleNamespace(dtype=torch.float32),
    )
    with pytest.raises(VLLMConfigError, match=r"^vLLM's cache_config\.cache_dtype is 'int4'"):
        _cache_dtype(vllm_config)
    vllm_config.cache_config.cache_dtype = "auto"
    vllm_config.model_config.dtype = torch.int16
    with pytest.raises(VLLMConfigError, match=r"^vLLM's model_config\.dtype is 'int16'"):
        _cache_dtype(vllm_config)


@pytest.mark.parametrize("status", list(VLLMRequestStatus), ids=lambda status: status.name)
def test_request_view_is_finished_exactly_when_vllm_s_request_is(
    status: VLLMRequestStatus,
) -> None:
    view = RequestView(types.SimpleNamespace(status=status))
    assert view.is_finished == VLLMRequestStatus.is_finished(status)


def test_block_id_deltas_become_full_block_lists() -> None:
    tables = BlockTables()
    first = tables.to_kvwire(scheduler_output([new_request("a", [4, 5])], cached_requests([], [])))
    second = tables.to_kvwire(scheduler_output([], cached_requests(["a"], [([9],)])))
    third = tables.to_kvwire(scheduler_output([], cached_requests(["a"], [None])))
    assert first.scheduled[0].block_ids == ([4, 5],)
    assert second.scheduled[0].block_ids == ([4, 5, 9],)
    assert third.scheduled[0].block_ids == ([4, 5, 9],)


def test_resumed_request_gets_its_whole_new_block_list() -> None:
    tables = BlockTables()
    tables.to_kvwire(scheduler_output([new_request("a", [4, 5])], cached_requests([], [])))
    tables.to_kvwire(scheduler_output([], cached_requests([], []), preempted={"a"}))
    resumed = tables.to_kvwire(
        scheduler_output([], cached_requests(["a"], [([7, 8, 9],)], resumed=frozenset({"a"})))
    )
    assert resumed.scheduled[0].block_ids == ([7, 8, 9],)
    assert resumed.scheduled[0].resumed_from_preemption


def test_finished_requests_are_forgotten() -> None:
    tables = BlockTables()
    tables.to_kvwire(scheduler_output([new_request("a", [4])], cached_requests([], [])))
    tables.to_kvwire(scheduler_output([], cached_requests([], []), finished={"a"}))
    assert len(tables) == 0


def test_second_update_after_an_async_load_is_not_passed_on() -> None:
    allocations = AllocationFilter()
    allocations.looked_up("a", load_async=True)
    assert allocations.should_forward("a", num_external_tokens=64)
    assert not allocations.should_forward("a", num_external_tokens=0)


def test_synchronous_load_allocation_is_passed_on_once_as_it_comes() -> None:
    allocations = AllocationFilter()
    allocations.looked_up("a", load_async=False)
    assert allocations.should_forward("a", num_external_tokens=64)
    assert allocations.should_forward("a", num_external_tokens=0)  # e.g. resumed later


def vllm_cpu_layout() -> BlockLayout:
    return BlockLayout(
        num_layers=2, block_size=32, num_kv_heads=2, head_size=32, dtype="float32",
        cache_layout="vllm_cpu",
    )  # fmt: skip


def test_vllm_cpu_blocks_round_trip_as_whole_byte_ranges() -> None:
    layout = vllm_cpu_layout()
    source = {f"l{i}": torch.randn(6, 2, 32, 64) for i in range(2)}
    target = {f"l{i}": torch.zeros(6, 2, 32, 64) for i in range(2)}
    entries = torch.empty(2, *layout.shape)
    PagedKVCaches(source, layout, ["l0", "l1"]).gather_many([3, 4], [0, 1], entries)
    PagedKVCaches(target, layout, ["l0", "l1"]).scatter_many(entries, [0, 1], [1, 5])
    for name in source:
        assert torch.equal(target[name][1], source[name][3])
        assert torch.equal(target[name][5], source[name][4])
        assert not target[name][0].any()


def test_vllm_cpu_cache_of_wrong_shape_is_refused_naming_the_layout() -> None:
    caches = {f"l{i}": torch.zeros(6, 32, 2, 64) for i in range(2)}
    with pytest.raises(ValueError, match="vLLM's CPU layout"):
        PagedKVCaches(caches, vllm_cpu_layout(), ["l0", "l1"])


def test_fingerprint_names_cache_layout_and_model_identity() -> None:
    base = vllm_cpu_layout()
    kvwire_layout = BlockLayout(
        num_layers=2, block_size=32, num_kv_heads=2, head_size=32, dtype="float32"
    )
    other_model = BlockLayout(
        num_layers=2, block_size=32, num_kv_heads=2, head_size=32, dtype="float32",
        cache_layout="vllm_cpu", model_identity="another/model",
    )  # fmt: skip
    assert len({base.fingerprint, kvwire_layout.fingerprint, other_model.fingerprint}) == 3


def test_stats_aggregate_by_adding_and_reduce_flat() -> None:
    stats = KVWireStats(data={"blocks_loaded": 2, "cpu": {"blocks_saved": 1}})
    stats.aggregate(KVWireStats(data={"blocks_loaded": 3, "cpu": {"blocks_saved": 4}}))
    assert stats.reduce() == {"blocks_loaded": 5, "cpu.blocks_saved": 5}
    assert metric_name("cpu.blocks_saved") == "vllm:kvwire_cpu_blocks_saved"


def test_events_become_vllm_events_with_token_ids_and_parent() -> None:
    tokens = BlockTokens(block_size=2)
    tokens.remember([b"h0", b"h1"], [10, 11, 12, 13, 14], start=0)
    events = tokens.to_vllm(
        [BlockStored(block_hashes=(b"h1",), medium="cpu"), BlockRemoved((b"h0",), "disk")]
    )
    stored, removed = events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (
        [b"h1"],
        b"h0",
        [12, 13],
    )
    assert (stored.medium, removed.medium, removed.block_hashes) == ("CPU", "STORAGE", [b"h0"])
    assert (stored.group_idx, removed.group_idx) == (None, None)


def test_events_carry_their_kv_cache_group_as_vllm_s_group_idx() -> None:
    tokens = BlockTokens(block_size=2)
    stored, removed = tokens.to_vllm(
        [BlockStored((b"h1",), "cpu", group=1), BlockRemoved((b"h0",), "disk", group=0)]
    )
    assert (stored.group_idx, removed.group_idx) == (1, 0)


def test_importing_kvwire_and_building_its_connectors_never_imports_vllm() -> None:
    probe = (
        "import sys, kvwire, kvwire.container, kvwire.connectors.offload; "
        "sys.exit('vllm' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0


def parallel_vllm_config(tensor: int, pipeline: int, kv_heads: int, layers: int = 2) -> Any:
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=tensor, pipeline_parallel_size=pipeline
        ),
        model_config=types.SimpleNamespace(
            get_total_num_kv_heads=lambda: kv_heads, get_total_num_hidden_layers=lambda: layers
        ),
    )


def test_the_parallel_layout_comes_from_vllm_s_config_alone() -> None:
    parallel = parallel_config_from_vllm(parallel_vllm_config(2, 1, 4))
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (2, 1)
    assert (parallel.rank, parallel.world_size) == (0, 2)


def test_a_tensor_parallel_size_that_does_not_divide_the_kv_heads_is_refused() -> None:
    with pytest.raises(
        VLLMConfigError, match=r"tensor_parallel_size 4 does not divide the model's 2"
    ):
        parallel_config_from_vllm(parallel_vllm_config(4, 1, 2))


def test_a_block_is_reported_stored_once_every_rank_stored_it() -> None:
    every_rank = EveryRank(world_size=2)
    a, b = b"a" * 32, b"b" * 32
    assert every_rank.whole([BlockStored((a, b), "disk", 0)]) == []
    assert every_rank.whole([BlockStored((a,), "disk", 0)]) == [BlockStored((a,), "disk", 0)]
    # A share removed is the block gone, and its count starts again.
    assert every_rank.whole([BlockRemoved((b,), "disk", 0)]) == [BlockRemoved((b,), "disk", 0)]
    assert every_rank.whole([BlockStored((b,), "disk", 0)]) == []


def test_each_pipeline_stage_s_layers_are_vllm_s_split() -> None:
    parallel = parallel_config_from_vllm(parallel_vllm_config(1, 2, 2, layers=5), rank=1)
    # vLLM gives the remainder to the stages before the last.
    assert parallel.pipeline_layers == (0, 3, 5)
    assert parallel.stage_layers(parallel.pipeline_rank) == range(3, 5)
