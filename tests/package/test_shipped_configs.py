"""Every configuration kvwire ships computes a failed load again: ``kv_load_failure_policy:
recompute`` in each profile (containers/, examples/) and in each README or docs
example that configures a connector, since vLLM's own default (``fail``) fails the user's
request."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
PROFILES = sorted(
    path
    for folder in ("containers", "examples")
    for path in (REPO / folder).rglob("*.yaml")
    if "kv_transfer_config" in path.read_text()
)
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
DOCUMENTS += sorted((REPO / "examples").rglob("*.md"))
FENCED_BLOCK = re.compile(r"^```[a-z]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# A block that configures a connector names one (vLLM's dict, a profile's YAML).
CONFIGURES_A_CONNECTOR = re.compile(r"""["']?kv_connector["']?\s*:""")
RECOMPUTE = re.compile(r"""["']?kv_load_failure_policy["']?\s*:\s*["']?recompute\b""")


def test_the_configurations_are_found() -> None:
    # The lists below cannot be empty by mistake (a moved folder would pass them all).
    assert len(PROFILES) >= 8
    assert len(configuring_blocks()) >= 2


@pytest.mark.parametrize("path", PROFILES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_shipped_profile_recomputes_failed_loads(path: pathlib.Path) -> None:
    transfer = yaml.safe_load(path.read_text())["kv_transfer_config"]
    assert transfer.get("kv_load_failure_policy") == "recompute"


def configuring_blocks() -> list[tuple[str, str]]:
    return [
        (f"{document.relative_to(REPO)}:{text[: match.start()].count(chr(10)) + 1}", block)
        for document in DOCUMENTS
        for text in [document.read_text()]
        for match in FENCED_BLOCK.finditer(text)
        for block in [match.group(1)]
        if CONFIGURES_A_CONNECTOR.search(block)
    ]


@pytest.mark.parametrize(
    "block", [pytest.param(block, id=where) for where, block in configuring_blocks()]
)
def test_every_documented_configuration_recomputes_failed_loads(block: str) -> None:
    assert RECOMPUTE.search(block)


@pytest.mark.parametrize("name", ["shared-storage.yaml", "redis.yaml"])
def test_a_store_profile_takes_a_whole_vllm_step_of_saves_in_flight(name: str) -> None:
    # A step of 8192 tokens (vLLM's --max-num-batched-tokens for long prompts) at
    # 32 KiB of KV per token computes 256 MiB; a smaller cap drops saves the next
    # request would load (--only serve counted 9-11 per run at 64 MiB).
    from kvwire.config.extra_config import parse_size

    profile = yaml.safe_load((REPO / "src" / "kvwire" / "profiles" / name).read_text())
    cap = profile["kv_transfer_config"]["kv_connector_extra_config"]["max_save_bytes_in_flight"]
    size = parse_size(cap)
    assert size is not None and size >= 8192 * 32 * 1024
