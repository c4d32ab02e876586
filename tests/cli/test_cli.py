"""``kvwire check`` and ``kvwire connectors``: what they print and their exit status."""

from __future__ import annotations

import io
import logging
import os
import pathlib
import subprocess
import sys

import pytest

from kvwire.cli import check_profile, list_connectors, main
from kvwire.config.profile import shipped_profile_names
from kvwire.registry import ConnectorRegistry
from tests.support.connectors import SAMPLES

REPO = pathlib.Path(__file__).resolve().parents[2]
SHIPPED_PROFILES = shipped_profile_names()


def run_check(
    tmp_path: pathlib.Path, text: str, registry: ConnectorRegistry | None = None
) -> tuple[int, str, str]:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    status = check_profile(str(path), registry=registry, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_check_explains_what_it_decided_and_why(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, out, err = run_check(
        tmp_path,
        "kv_transfer_config: {kv_connector: HMAConnector, kv_role: kv_producer}\n",
        registry,
    )

    assert (status, err) == (0, "")
    assert out.splitlines() == [
        f"profile {tmp_path / 'profile.yaml'}: valid",
        f"connector: HMAConnector -> {SAMPLES}:HMAConnector (registered at run time)",
        "constructor: accepts (config, role, kv_cache_config)",
        "extra config: not checked (HMAConnector has no validate_extra_config)",
        "kv_role: kv_producer (producer: yes, consumer: no); load failure policy: recompute",
        "HMA: enabled (disable_hybrid_kv_cache_manager is unset and HMAConnector supports HMA: "
        "HMA stays on)",
        "KV cache groups: 1 (every layer full attention: HMA changes nothing for this model)",
        "ok",
    ]


def test_check_names_a_module_path_and_a_composite(tmp_path: pathlib.Path) -> None:
    status, out, _ = run_check(
        tmp_path,
        "scheduler_config: {disable_hybrid_kv_cache_manager: true}\n"
        "kv_transfer_config:\n"
        "  kv_connector: CompositeConnector\n"
        f"  kv_connector_module_path: {SAMPLES}\n"
        "  kv_role: kv_both\n",
    )

    assert status == 0
    lines = out.splitlines()
    assert lines[1] == (
        f"connector: CompositeConnector -> {SAMPLES}:CompositeConnector "
        f"(module path {SAMPLES}, which wins over the registry)"
    )
    assert lines[2] == (
        "constructor: accepts (config, role, kv_cache_config); a composite, it receives a "
        "connector_builder for its children"
    )
    assert lines[3] == (
        "extra config: not checked (CompositeConnector has no validate_extra_config)"
    )
    assert lines[5] == "HMA: disabled (disable_hybrid_kv_cache_manager is true: HMA is off)"


def test_check_of_a_profile_without_a_connector_succeeds(tmp_path: pathlib.Path) -> None:
    status, out, _ = run_check(tmp_path, "cache_config: {block_size: 8}\n")

    assert status == 0
    assert out.splitlines()[1] == (
        "connector: none (kv_transfer_config names no connector); nothing to resolve"
    )


def test_check_of_an_invalid_profile_prints_every_problem_and_fails(
    tmp_path: pathlib.Path,
) -> None:
    status, out, err = run_check(
        tmp_path, "kv_transfer_config: {kv_connector: X, kv_role: producer, kv_port: 0}\n"
    )

    assert (status, out) == (1, "")
    assert err == (
        f"kvwire check: {tmp_path / 'profile.yaml'}: error: invalid profile "
        f"{tmp_path / 'profile.yaml'} (2 problems):\n"
        "  kv_transfer_config.kv_role: 'producer' is not one of kv_producer, kv_consumer, "
        "kv_both\n"
        "  kv_transfer_config.kv_port: kv_port must be between 1 and 65535, got 0\n"
    )


def test_check_of_an_unknown_connector_fails_with_the_reference_message(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, _, err = run_check(
        tmp_path, "kv_transfer_config: {kv_connector: Nope, kv_role: kv_both}\n", registry
    )

    assert status == 1
    assert "error: Unsupported connector type: Nope; known connectors: " in err


def test_check_of_a_deprecated_constructor_fails(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, _, err = run_check(
        tmp_path,
        "kv_transfer_config: {kv_connector: TwoArgumentConnector, kv_role: kv_both}\n",
        registry,
    )

    assert status == 1
    assert "error: Connector TwoArgumentConnector uses deprecated 2-argument constructor" in err


def test_check_of_hma_demanded_from_a_connector_without_it_fails(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, _, err = run_check(
        tmp_path,
        "scheduler_config: {disable_hybrid_kv_cache_manager: false}\n"
        "kv_transfer_config: {kv_connector: RecordingConnector, kv_role: kv_both}\n",
        registry,
    )

    assert status == 1
    assert err.endswith(
        "error: Connector RecordingConnector does not support HMA but HMA is enabled. "
        "Please set `--disable-hybrid-kv-cache-manager`.\n"
    )


@pytest.mark.torch
@pytest.mark.parametrize("profile", SHIPPED_PROFILES)
def test_every_shipped_profile_passes_check_by_name(
    profile: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["check", profile])

    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.out.splitlines()[-1] == "ok"


def test_at_least_two_profiles_are_shipped() -> None:
    assert len(SHIPPED_PROFILES) >= 2


def test_connectors_lists_name_source_and_module(registry: ConnectorRegistry) -> None:
    out = io.StringIO()

    assert list_connectors(resolve=False, registry=registry, out=out) == 0

    lines = out.getvalue().splitlines()
    assert lines[0] == "NAME".ljust(20) + "  " + "SOURCE".ljust(22) + "  MODULE"
    assert lines[1] == (
        "RecordingConnector".ljust(20)
        + "  registered at run time  "
        + f"{SAMPLES}:RecordingConnector"
    )


CPU_POOL = "kvwire.media.cpu_pool.medium:CPUPoolMedium"


def _connector_rows(listing: str) -> dict[str, str]:
    connectors = listing.split("\n\n")[0]
    return {line.split()[0]: line for line in connectors.splitlines()[1:]}


def test_connectors_lists_the_media_after_the_connectors(registry: ConnectorRegistry) -> None:
    out = io.StringIO()
    registry.media.register_medium("tape", "tape_medium", "TapeMedium")

    assert list_connectors(resolve=False, registry=registry, out=out) == 0

    media = out.getvalue().split("\n\n")[1].splitlines()
    assert media[0].split() == ["MEDIUM", "SOURCE", "MODULE"]
    assert [line.split()[0] for line in media[1:]] == [
        "cpu_pool",
        "directory",
        "peer",
        "redis",
        "tiered",
        "tape",
    ]
    assert media[1].split(maxsplit=1)[1].split() == ["built", "in", CPU_POOL]
    assert media[6].endswith("registered at run time  tape_medium:TapeMedium")


def test_connectors_lists_the_eviction_policies_last(registry: ConnectorRegistry) -> None:
    out = io.StringIO()
    registry.eviction_policies.register_policy("fifo", "fifo_policy", "FIFOPolicy")

    assert list_connectors(resolve=False, registry=registry, out=out) == 0

    policies = out.getvalue().split("\n\n")[2].splitlines()
    assert policies[0].split() == ["EVICTION", "SOURCE", "MODULE"]
    assert [line.split()[0] for line in policies[1:]] == [
        "lru",
        "s3fifo",
        "arc",
        "kvfifo",
        "fifo",
    ]
    assert policies[1].split(maxsplit=1)[1].split() == [
        "built",
        "in",
        "kvwire.media.eviction:LRUPolicy",
    ]
    assert policies[5].endswith("registered at run time  fifo_policy:FIFOPolicy")


def test_connectors_with_resolve_says_whether_each_supports_hma(
    registry: ConnectorRegistry,
) -> None:
    out = io.StringIO()

    status = list_connectors(resolve=True, registry=registry, out=out)

    rows = _connector_rows(out.getvalue())
    assert rows["RecordingConnector"].endswith(
        "  no (does not subclass SupportsHMA: the gate turns HMA off, and "
        "disable_hybrid_kv_cache_manager: false is an error)"
    )
    assert rows["HMAConnector"].endswith("  yes (subclasses SupportsHMA: the gate keeps HMA on)")
    assert rows["CompositeConnector"].endswith(
        "  depends on its configuration: CompositeConnector.supports_hma_for_config decides"
    )
    assert "error: Connector TwoArgumentConnector uses deprecated" in rows["TwoArgumentConnector"]
    assert status == 1


@pytest.mark.torch  # resolving a built-in imports its module, which needs the torch extra
def test_connectors_with_resolve_says_every_built_in_serves_hma() -> None:
    out = io.StringIO()

    status = list_connectors(resolve=True, registry=ConnectorRegistry(), out=out)

    rows = _connector_rows(out.getvalue())
    for name in ("CPUOffloadConnector", "SharedStorageConnector", "RedisConnector"):
        assert rows[name].endswith("  yes (subclasses SupportsHMA: the gate keeps HMA on)"), name
    assert rows["MultiConnector"].endswith(
        "  depends on its configuration: HMA when every child in "
        "kv_connector_extra_config.connectors supports it"
    )
    assert status == 0


_CONNECTOR_PACKAGES = ("kvwire.connectors", "kvwire.media", "kvwire.blocks", "kvwire.engine")


def test_the_plain_listing_imports_no_connector_and_no_torch() -> None:
    probe = (
        "import sys\n"
        "from kvwire.cli import main\n"
        "status = main(['connectors'])\n"
        "loaded = [m for m in sys.modules if m == 'torch' or m.startswith(('kvwire.connectors', "
        "'kvwire.media', 'kvwire.blocks', 'kvwire.engine'))]\n"
        "print('LOADED', loaded, status)\n"
    )

    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )

    assert "CPUOffloadConnector" in result.stdout
    assert result.stdout.splitlines()[-1] == "LOADED [] 0"


def test_importing_kvwire_imports_no_connector_and_no_torch() -> None:
    probe = (
        "import sys, kvwire\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvwire.')))\n"
    )

    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )

    loaded = eval(result.stdout)
    assert "torch" not in loaded
    assert not [name for name in loaded if name.startswith(_CONNECTOR_PACKAGES)]


def test_a_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main([])

    assert caught.value.code == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


def test_run_is_dispatched_to_the_run_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["run", "--help"])

    assert caught.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvwire run")
    # The options came from kvwire.run's configure_parser, not a placeholder.
    assert "kvwire.run" in sys.modules


@pytest.mark.torch
def test_check_of_several_profiles_fails_if_any_fails(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("cache_config: {block_size: 0}\n")

    status = main(["check", SHIPPED_PROFILES[0], str(broken)])

    captured = capsys.readouterr()
    assert status == 1
    assert captured.out.splitlines()[-1] == "ok"
    assert captured.err.endswith("  cache_config.block_size: block_size must be > 0, got 0\n")


def test_check_resolves_each_child_of_a_composite(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, out, _ = run_check(
        tmp_path,
        "kv_transfer_config:\n"
        "  kv_connector: CompositeConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    connectors: [{kv_connector: HMAConnector}, {kv_connector: RecordingConnector}]\n",
        registry,
    )

    assert status == 0
    assert out.splitlines()[3:5] == [
        f"  child 0: HMAConnector -> {SAMPLES}:HMAConnector (registered at run time); "
        "supports HMA: yes",
        f"  child 1: RecordingConnector -> {SAMPLES}:RecordingConnector (registered at run "
        "time); supports HMA: no",
    ]
    assert out.splitlines()[-3] == (
        "HMA: disabled (disable_hybrid_kv_cache_manager is unset and CompositeConnector does "
        "not support HMA: HMA is turned off)"
    )


HYBRID_MODEL = (
    "model_config:\n"
    "  num_layers: 4\n"
    "  layer_types: [sliding_attention, full_attention, sliding_attention, full_attention]\n"
    "  sliding_window: 64\n"
)
HYBRID_GROUPS = (
    "KV cache groups: 2 with HMA on (group 0: full attention, layers.1.attn, layers.3.attn; "
    "group 1: sliding window 64, layers.0.attn, layers.2.attn); a sliding-window group keeps "
    "and moves only the blocks inside its window"
)
ONE_GROUP = (
    "KV cache groups: 1 with HMA off (the sliding-window layers share one full-attention "
    "group: every block of every layer is kept and moved)"
)
BUILT_IN_CONNECTORS = {
    "CPUOffloadConnector": "{cpu_pool_bytes: 4MiB}",
    "SharedStorageConnector": "{shared_storage_path: /tmp/kvwire-check-store}",
    "RedisConnector": "{url: redis://127.0.0.1:6379/0}",
}


def _hybrid_profile(connector: str, extra: str, switch: str = "") -> str:
    return (
        HYBRID_MODEL
        + switch
        + "kv_transfer_config:\n"
        + f"  kv_connector: {connector}\n"
        + "  kv_role: kv_both\n"
        + f"  kv_connector_extra_config: {extra}\n"
    )


@pytest.mark.torch  # resolving a built-in imports its module, which needs the torch extra
@pytest.mark.parametrize("connector", sorted(BUILT_IN_CONNECTORS))
def test_check_keeps_hma_on_for_a_hybrid_model_with_each_built_in(
    tmp_path: pathlib.Path, connector: str
) -> None:
    status, out, err = run_check(
        tmp_path, _hybrid_profile(connector, BUILT_IN_CONNECTORS[connector])
    )

    assert (status, err) == (0, "")
    assert out.splitlines()[-3:] == [
        f"HMA: enabled (disable_hybrid_kv_cache_manager is unset and {connector} supports HMA: "
        "HMA stays on)",
        HYBRID_GROUPS,
        "ok",
    ]


@pytest.mark.torch  # resolving a built-in imports its module, which needs the torch extra
def test_check_keeps_hma_on_for_a_multi_connector_of_built_ins(tmp_path: pathlib.Path) -> None:
    children = ", ".join(
        f"{{kv_connector: {name}, kv_connector_extra_config: {extra}}}"
        for name, extra in sorted(BUILT_IN_CONNECTORS.items())
    )
    status, out, err = run_check(
        tmp_path, _hybrid_profile("MultiConnector", f"{{connectors: [{children}]}}")
    )

    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert [line.split(";")[1] for line in lines if line.startswith("  child ")] == [
        " supports HMA: yes"
    ] * 3
    assert lines[-3:] == [
        "HMA: enabled (disable_hybrid_kv_cache_manager is unset and MultiConnector supports HMA: "
        "HMA stays on)",
        HYBRID_GROUPS,
        "ok",
    ]


def test_check_turns_hma_off_for_a_hybrid_model_with_a_connector_without_it(
    tmp_path: pathlib.Path, registry: ConnectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvwire.hma"):
        status, out, err = run_check(
            tmp_path, _hybrid_profile("RecordingConnector", "{}"), registry
        )

    reason = (
        "disable_hybrid_kv_cache_manager is unset and RecordingConnector does not support HMA: "
        "HMA is turned off"
    )
    assert (status, err) == (0, "")
    assert out.splitlines()[-3:] == [f"HMA: disabled ({reason})", ONE_GROUP, "ok"]
    assert f"HMA gate: {reason}" in caplog.messages


def test_check_of_a_hybrid_model_demanding_hma_from_a_connector_without_it_fails(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, out, err = run_check(
        tmp_path,
        _hybrid_profile(
            "RecordingConnector",
            "{}",
            "scheduler_config: {disable_hybrid_kv_cache_manager: false}\n",
        ),
        registry,
    )

    assert (status, out) == (1, "")
    assert err.endswith(
        "error: Connector RecordingConnector does not support HMA but HMA is enabled. "
        "Please set `--disable-hybrid-kv-cache-manager`.\n"
    )


@pytest.mark.torch  # resolving a built-in imports its module, which needs the torch extra
def test_check_of_a_hybrid_model_with_hma_disabled_says_one_group(
    tmp_path: pathlib.Path,
) -> None:
    status, out, _ = run_check(
        tmp_path,
        _hybrid_profile(
            "CPUOffloadConnector",
            BUILT_IN_CONNECTORS["CPUOffloadConnector"],
            "scheduler_config: {disable_hybrid_kv_cache_manager: true}\n",
        ),
    )

    assert status == 0
    assert out.splitlines()[-3:] == [
        "HMA: disabled (disable_hybrid_kv_cache_manager is true: HMA is off)",
        ONE_GROUP,
        "ok",
    ]


def test_check_names_the_child_that_cannot_be_resolved(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, _, err = run_check(
        tmp_path,
        "scheduler_config: {disable_hybrid_kv_cache_manager: true}\n"
        "kv_transfer_config:\n"
        "  kv_connector: CompositeConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    connectors: [{kv_connector: HMAConnector}, {kv_connector: Nope}]\n",
        registry,
    )

    assert status == 1
    assert (
        "error: kv_transfer_config.kv_connector_extra_config.connectors[1]: "
        "Unsupported connector type: Nope; known connectors: "
    ) in err


def test_check_help_says_that_it_imports_the_connectors_module(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])

    help_text = " ".join(capsys.readouterr().out.split())
    assert "imports its module" in help_text
    assert "runs that module's code with your rights" in help_text
    assert "check only profiles and plugins you trust" in help_text


def test_the_command_list_warns_that_check_runs_plugin_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])

    assert "(imports the connector's module: runs its code)" in " ".join(
        capsys.readouterr().out.split()
    )


def test_a_profile_argument_with_a_nul_byte_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["check", "ok.yaml", "bad\x00.yaml"])

    assert caught.value.code == 2
    assert capsys.readouterr().err.endswith(
        "kvwire: error: argument 3 contains a NUL byte (\\x00), which no path or name can hold\n"
    )


@pytest.mark.parametrize("arguments", [["--prompts", "p\x00.jsonl"], ["--prompts=p\x00.jsonl"]])
def test_an_option_value_with_a_nul_byte_names_the_option(
    arguments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["run", *arguments])

    assert "kvwire: error: the value of --prompts contains a NUL byte" in capsys.readouterr().err


def test_check_of_a_path_with_a_nul_byte_names_the_path_problem(tmp_path: pathlib.Path) -> None:
    out, err = io.StringIO(), io.StringIO()

    status = check_profile(str(tmp_path / "a\x00.yaml"), out=out, err=err)

    assert status == 1
    assert err.getvalue().endswith(
        "  the profile path contains a NUL byte (\\x00), which no file name can hold\n"
    )
    assert "\x00" not in err.getvalue()


@pytest.mark.torch
def test_run_blanks_a_secret_quoted_by_value_in_an_error_as_check_does(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The password pasted into the wrong field: the error quotes that field's value.
    monkeypatch.setenv("KVWIRE_TEST_REDIS_PASSWORD", "pasted-in-the-wrong-field")
    profile = tmp_path / "redis.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: RedisConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    url: redis+cluster://127.0.0.1:1\n"
        "    password_env: KVWIRE_TEST_REDIS_PASSWORD\n"
        "    key_prefix: 'pasted-in-the-wrong-field{x}'\n"
    )

    assert main(["run", str(profile), "--no-progress"]) == 2

    error = capsys.readouterr().err
    assert "kv_connector_extra_config.key_prefix" in error
    assert "pasted-in-the-wrong-field" not in error


def _module_path_profile(module_path: str) -> str:
    return (
        "kv_transfer_config:\n"
        "  kv_connector: RecordingConnector\n"
        "  kv_role: kv_both\n"
        f"  kv_connector_module_path: {module_path}\n"
    )


@pytest.mark.parametrize(
    ("module_path", "problem"),
    [
        ("os", "Class RecordingConnector not found in os; expected a module defining the class "),
        ("no.such.mod", "cannot import 'no.such.mod': ModuleNotFoundError: No module named 'no'"),
        ("'.relative'", "'.relative' is not a module path; expected an absolute dotted module"),
        (
            "tests.support.plugin_modules.exiting",
            "cannot import 'tests.support.plugin_modules.exiting': SystemExit: "
            "plugin settings from redis://u:***@h",
        ),
    ],
)
def test_check_names_the_module_path_field_that_cannot_be_loaded(
    module_path: str, problem: str, tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, _, err = run_check(tmp_path, _module_path_profile(module_path), registry)

    assert status == 1
    assert f"error: kv_transfer_config.kv_connector_module_path: {problem}" in err
    assert "hunter2" not in err


def test_check_names_a_childs_module_path_field(
    tmp_path: pathlib.Path, registry: ConnectorRegistry
) -> None:
    status, _, err = run_check(
        tmp_path,
        "kv_transfer_config:\n"
        "  kv_connector: CompositeConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    connectors:\n"
        "    - {kv_connector: HMAConnector}\n"
        "    - {kv_connector: HMAConnector, kv_connector_module_path: os}\n",
        registry,
    )

    assert status == 1
    assert err.endswith(
        "error: kv_transfer_config.kv_connector_extra_config.connectors[1]"
        ".kv_connector_module_path: Class HMAConnector not found in os; expected a module "
        "defining the class kv_transfer_config.kv_connector_extra_config.connectors[1]"
        ".kv_connector names\n"
    )


def test_check_reports_a_keyboard_interrupt_a_module_raises_at_import_as_its_error(
    tmp_path: pathlib.Path,
) -> None:
    # No Ctrl-C behind it: the plug-in's failure, reported, not an interrupted check.
    # In a subprocess: a KeyboardInterrupt that escaped would stop this test session.
    profile = tmp_path / "profile.yaml"
    profile.write_text(_module_path_profile("tests.support.plugin_modules.interrupting"))
    result = subprocess.run(
        [sys.executable, "-m", "kvwire", "check", str(profile)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )

    assert result.returncode == 1, result.stderr
    assert (
        "error: kv_transfer_config.kv_connector_module_path: cannot import "
        "'tests.support.plugin_modules.interrupting': KeyboardInterrupt: plugin gave up on "
        "redis://u:***@h"
    ) in result.stderr
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr


@pytest.mark.parametrize(
    ("connector", "problem"),
    [
        (
            "RaisingHMAHookConnector",
            "kv_transfer_config.kv_connector: RaisingHMAHookConnector.supports_hma_for_config "
            "raised RuntimeError: lost redis://u:***@h",
        ),
        (
            "ExitingHMAHookConnector",
            "kv_transfer_config.kv_connector: ExitingHMAHookConnector.supports_hma_for_config "
            "raised SystemExit: lost redis://u:***@h",
        ),
        (
            "ExitingValidationConnector",
            "kv_connector_extra_config: ExitingValidationConnector.validate_extra_config raised "
            "SystemExit: lost redis://u:***@h",
        ),
    ],
)
def test_check_names_a_connector_hook_that_raises_or_exits_redacted(
    connector: str, problem: str, tmp_path: pathlib.Path
) -> None:
    status, _, err = run_check(
        tmp_path,
        "kv_transfer_config:\n"
        f"  kv_connector: {connector}\n"
        "  kv_role: kv_both\n"
        "  kv_connector_module_path: tests.support.connectors\n",
    )

    assert status == 1
    assert f"error: {problem}" in err
    assert "hunter2" not in err


@pytest.mark.parametrize(
    "arguments",
    [
        ["--log-level", "x" * 100_000, "check", "profile.yaml"],
        ["y" * 100_000],
        ["check", "profile.yaml", "--bogus", "z" * 100_000],
    ],
)
def test_a_usage_error_shows_a_long_value_cut_short(
    arguments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)

    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "... (a str of 100000 characters)" in err
    assert len(err) < 1500


@pytest.mark.parametrize("command", [["profiles"], ["connectors"], ["profiles", "--show", "redis"]])
def test_a_reader_that_closed_the_pipe_ends_the_command_quietly(command: list[str]) -> None:
    """`kvwire profiles | head -1`: the reader gone before the first write, every time."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "kvwire", *command],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)

    assert completed.stderr == ""
    assert completed.returncode == 141
