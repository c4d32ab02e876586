"""What KVWireConnector takes from vLLM's configuration, checked on a connector built directly."""

from __future__ import annotations

import logging
import pathlib
import types
from typing import Any

import pytest
import torch

from kvwire.exceptions import VLLMConfigError
from kvwire.vllm import KVWireConnector
from kvwire.vllm.config_bridge import vllm_model_identity
from tests.support.vllm import (
    BLOCK_SIZE,
    SLIDING_WINDOW,
    GroupsConnector,
    PlainConnector,
    kvwire_transfer_config,
    load_profile_mapping,
    wrapping_profile,
)


def vllm_config(
    model: str, profile: dict[str, Any] | None = None, hma: bool | None = None, **transfer: Any
) -> Any:
    """vLLM's config for ``model`` served by KVWireConnector (``hma``: vLLM's HMA setting).

    A ``transfer`` field given as None is left out (vLLM's default applies).
    """
    from vllm.engine.arg_utils import EngineArgs

    mapping = profile or load_profile_mapping("cpu-offload.yaml")
    merged = {**kvwire_transfer_config(mapping), **transfer}
    config = {name: value for name, value in merged.items() if value is not None}
    return EngineArgs(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        enforce_eager=True,
        kv_transfer_config=config,
        disable_hybrid_kv_cache_manager=None if hma is None else not hma,
    ).create_engine_config()


def vllm_kv_cache_config(hybrid: bool = False) -> Any:
    """A vLLM KVCacheConfig of 8 blocks: two full-attention layers, or the hybrid Gemma's groups.

    The hybrid one is what vLLM builds for ``tiny_hybrid_model`` with HMA on:
    a sliding-window group (layers 0, 2) and a full one (1, 3), each tensor
    shared by one layer of each group.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    shape = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    full = FullAttentionSpec(**shape)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4 if hybrid else 2)]
    if hybrid:
        sliding = SlidingWindowSpec(sliding_window=SLIDING_WINDOW, **shape)
        groups = [
            KVCacheGroupSpec(layer_names=layers[0::2], kv_cache_spec=sliding),
            KVCacheGroupSpec(layer_names=layers[1::2], kv_cache_spec=full),
        ]
        shared_by = [list(pair) for pair in zip(layers[0::2], layers[1::2], strict=True)]
    else:
        groups = [KVCacheGroupSpec(layer_names=layers, kv_cache_spec=full)]
        shared_by = [[name] for name in layers]
    tensors = [
        KVCacheTensor(
            size=full.page_size_bytes * 8,
            layers=names,
            layer_stride=0,
            block_stride=full.page_size_bytes,
        )
        for names in shared_by
    ]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=tensors, kv_cache_groups=groups)


def scheduler_connector(connector_class: type, config: Any, hybrid: bool = False) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return connector_class(config, KVConnectorRole.SCHEDULER, vllm_kv_cache_config(hybrid))


def finished_request(request_id: str = "r") -> Any:
    from vllm.v1.request import RequestStatus

    return types.SimpleNamespace(
        request_id=request_id, status=RequestStatus.FINISHED_STOPPED, block_hashes=[]
    )


def test_load_failure_policy_and_role_are_vllm_s(tiny_model: str) -> None:
    config = vllm_config(tiny_model, kv_role="kv_producer", kv_load_failure_policy="fail")
    wrapped = scheduler_connector(KVWireConnector, config).connector
    assert wrapped.kv_transfer_config.kv_load_failure_policy == "fail"
    assert wrapped.kv_transfer_config.kv_role == "kv_producer"


@pytest.mark.parametrize(("policy", "warnings"), [(None, 1), ("fail", 1), ("recompute", 0)])
def test_vllm_s_fail_policy_is_warned_about_once_naming_the_field(
    policy: str | None, warnings: int, tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = vllm_config(tiny_model, kv_load_failure_policy=policy)  # None: vLLM's default
    with caplog.at_level(logging.WARNING, logger="kvwire.vllm.connector"):
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            KVWireConnector(config, role, vllm_kv_cache_config())
    warned = [
        record.getMessage()
        for record in caplog.records
        if record.name == "kvwire.vllm.connector" and record.levelno == logging.WARNING
    ]
    assert len(warned) == warnings
    for message in warned:
        assert "kv_transfer_config.kv_load_failure_policy is 'fail'" in message
        assert '"kv_load_failure_policy": "recompute"' in message


def test_each_role_logs_one_line_saying_what_kvwire_runs(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = vllm_config(tiny_model, load_profile_mapping("cpu-offload.yaml"))
    with caplog.at_level(logging.INFO, logger="kvwire.vllm.connector"):
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            KVWireConnector(config, role, vllm_kv_cache_config()).shutdown()
    started = [
        record.getMessage()
        for record in caplog.records
        if record.name == "kvwire.vllm.connector" and "connector: " in record.getMessage()
    ]

    assert [line.split(" connector: ")[0] for line in started] == [
        "kvwire scheduler",
        "kvwire worker",
    ]
    for line in started:
        assert "CPUOffloadConnector over the CPUPoolMedium medium" in line
        assert "'cpu_pool_bytes'" in line and "profile given inline" in line


def test_each_profile_value_vllm_overrides_is_warned_about_once_naming_both_values(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    profile = load_profile_mapping("cpu-offload.yaml")
    profile["model_config"]["num_kv_heads"] = 4
    profile["cache_config"]["block_size"] = 64
    profile["kv_transfer_config"].update(engine_id="prefill-0", kv_load_failure_policy="fail")
    config = vllm_config(
        tiny_model, profile, kv_role="kv_producer", kv_load_failure_policy="recompute"
    )
    with caplog.at_level(logging.WARNING, logger="kvwire.vllm"):
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            KVWireConnector(config, role, vllm_kv_cache_config()).shutdown()
    warned = sorted(
        record.getMessage()
        for record in caplog.records
        if record.name == "kvwire.vllm.overrides" and record.levelno == logging.WARNING
    )

    engine_id = config.kv_transfer_config.engine_id
    assert warned == [
        f"cache_config.block_size: the kvwire profile says 64, vLLM's configuration says "
        f"{BLOCK_SIZE}; vLLM's applies",
        f"kv_transfer_config.engine_id: the kvwire profile says 'prefill-0', vLLM's "
        f"configuration says '{engine_id}'; vLLM's applies",
        "kv_transfer_config.kv_load_failure_policy: the kvwire profile says 'fail', vLLM's "
        "configuration says 'recompute'; vLLM's applies",
        "kv_transfer_config.kv_role: the kvwire profile says 'kv_both', vLLM's configuration "
        "says 'kv_producer'; vLLM's applies",
        "model_config.num_kv_heads: the kvwire profile says 4, vLLM's configuration says 2; "
        "vLLM's applies",
    ]


def test_profile_values_left_at_kvwire_s_defaults_are_replaced_quietly(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The shipped profile's model and cache sections are kvwire's defaults, and
    # its engine_id is unset: vLLM's values replace them without a word.
    config = vllm_config(tiny_model, load_profile_mapping("cpu-offload.yaml"))
    with caplog.at_level(logging.WARNING, logger="kvwire.vllm"):
        scheduler_connector(KVWireConnector, config).shutdown()

    assert [record for record in caplog.records if record.name == "kvwire.vllm.overrides"] == []


def test_a_best_effort_cache_never_requires_kv_delivery(tiny_model: str) -> None:
    connector = scheduler_connector(KVWireConnector, vllm_config(tiny_model, kv_role="kv_producer"))
    assert connector.requires_kv_delivery is False


def test_stored_blocks_are_named_by_model_dtype_block_size_and_vllm_cpu_layout(
    tiny_model: str,
) -> None:
    layout = scheduler_connector(KVWireConnector, vllm_config(tiny_model)).connector.layout
    assert (layout.dtype, layout.block_size, layout.cache_layout) == (
        "float32",
        BLOCK_SIZE,
        "vllm_cpu",
    )
    # The weights name the model, never the path they were found at.
    assert layout.model_identity.startswith("weights:")
    assert tiny_model not in layout.model_identity
    assert "dtype=torch.float32" in layout.model_identity


def test_the_profile_s_model_identity_names_the_model_instead_of_its_files(
    tiny_model: str,
) -> None:
    profile = load_profile_mapping("cpu-offload.yaml")
    profile["model_config"]["identity"] = "acme-llama-ft-7"
    layout = scheduler_connector(KVWireConnector, vllm_config(tiny_model, profile)).connector.layout
    assert layout.model_identity.startswith("explicit:acme-llama-ft-7;")


def hub_model_config(model: str, download_dir: str) -> Any:
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            model=model, revision=None, dtype="bfloat16", quantization=None, hf_overrides={}
        ),
        load_config=types.SimpleNamespace(download_dir=download_dir),
    )


def test_a_hub_id_whose_commit_is_not_known_locally_is_refused_naming_the_field(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VLLMConfigError, match=r"model_config\.identity: the model 'org/model'"):
        vllm_model_identity(hub_model_config("org/model", str(tmp_path / "downloads")))
    # An operator's identity is trusted instead.
    named = vllm_model_identity(hub_model_config("org/model", str(tmp_path)), "org-model-v3")
    assert named.startswith("explicit:org-model-v3;dtype=bfloat16")


def test_a_hub_id_resolves_through_vllm_s_download_dir(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit = "ab" * 20
    folder = tmp_path / "downloads" / "models--org--model"
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    identity = vllm_model_identity(hub_model_config("org/model", str(tmp_path / "downloads")))
    assert identity.startswith(f"hub-commit:{commit};")


@pytest.mark.parametrize("wrapped", ["cpu-offload.yaml", "plain"])
def test_vllm_s_gate_keeps_hma_on_for_kvwire_connector_whatever_it_wraps(
    wrapped: str, tiny_hybrid_model: str
) -> None:
    # vLLM asks the class (issubclass(cls, SupportsHMA)) before any profile is read.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    profile = (
        wrapping_profile(PlainConnector) if wrapped == "plain" else load_profile_mapping(wrapped)
    )
    config = vllm_config(tiny_hybrid_model, profile)
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False


def test_a_hybrid_cache_refuses_a_wrapped_connector_without_hma_naming_the_flag(
    tiny_hybrid_model: str,
) -> None:
    config = vllm_config(tiny_hybrid_model, wrapping_profile(PlainConnector))
    with pytest.raises(VLLMConfigError, match="PlainConnector does not support it") as error:
        scheduler_connector(KVWireConnector, config, hybrid=True)
    assert "--disable-hybrid-kv-cache-manager" in str(error.value)
    assert "SlidingWindowSpec (2 layers), FullAttentionSpec (2 layers)" in str(error.value)


@pytest.mark.parametrize("hma", [None, True, False])
def test_one_full_attention_group_is_served_by_a_wrapped_connector_without_hma(
    hma: bool | None, tiny_model: str
) -> None:
    # HMA on or off, a model without sliding-window layers has one group.
    config = vllm_config(tiny_model, wrapping_profile(PlainConnector), hma=hma)
    connector = scheduler_connector(KVWireConnector, config)
    wrapped = connector.connector
    # kvwire's gate turned HMA off for it: it serves one group.
    assert wrapped.engine_config.scheduler_config.disable_hybrid_kv_cache_manager is True
    assert connector.request_finished_all_groups(finished_request(), ([3, 4],)) == (False, None)
    assert wrapped.finished == [("request_finished", [3, 4])]


def test_a_wrapped_connector_with_hma_gets_every_group_s_block_ids(
    tiny_hybrid_model: str,
) -> None:
    config = vllm_config(tiny_hybrid_model, wrapping_profile(GroupsConnector))
    connector = scheduler_connector(KVWireConnector, config, hybrid=True)
    wrapped = connector.connector
    assert wrapped.engine_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert [
        getattr(group.kv_cache_spec, "sliding_window", None)
        for group in wrapped.kv_cache_config.kv_cache_groups
    ] == [SLIDING_WINDOW, None]
    block_ids = ([0, 0, 5, 6], [1, 2, 3, 4])  # the sliding group's first blocks left the window
    assert connector.request_finished_all_groups(finished_request(), block_ids) == (False, None)
    assert connector.request_finished(finished_request("s"), [7]) == (False, None)
    assert wrapped.finished == [
        ("request_finished_all_groups", ([0, 0, 5, 6], [1, 2, 3, 4])),
        ("request_finished_all_groups", ([7],)),
    ]
