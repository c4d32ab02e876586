"""``kvwire run``'s input is bounded: each refusal names its flag, comes before anything is
built, and shows no unbounded value.

Runs that a missing bound would let grow (``/dev/zero``, a terabyte file,
a hundred million tokens) run in a subprocess with a 2 GiB address space
and a timeout, so that a regression fails the test instead of the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import yaml

from kvwire import cli
from kvwire.config.profile import DEFAULT_PROFILE_NAME, shipped_profile_path
from kvwire.engine.workload import MAX_PROMPTS_BYTES, MAX_PROMPTS_LINES
from kvwire.run.command import MAX_REQUESTS, MAX_WORKLOAD_TOKENS

REPO = pathlib.Path(__file__).parents[2]
ADDRESS_SPACE = 2 * 2**30
KVWIRE = "import sys; from kvwire.cli import main; sys.exit(main())"


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def kvwire(
    *arguments: str, stdin: int | None = subprocess.DEVNULL, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``kvwire ARGUMENTS`` in a subprocess of bounded memory and time."""
    return subprocess.run(
        [sys.executable, "-c", KVWIRE, *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=stdin,
        preexec_fn=_limited,
        cwd=REPO,
        env=env,
    )


def refusal(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return result.stderr


# ------------------------------------------------------------ the prompts file


@pytest.mark.slow
def test_dev_zero_as_prompts_is_refused_as_a_character_device_before_reading() -> None:
    err = refusal(kvwire("run", "--prompts", "/dev/zero", "--no-progress"))
    assert "kvwire run: error: --prompts: /dev/zero: it is a character device, not a regular " in (
        err
    )


@pytest.mark.slow
def test_a_fifo_as_prompts_is_refused_without_waiting_for_a_writer(
    tmp_path: pathlib.Path,
) -> None:
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    err = refusal(kvwire("run", "--prompts", str(fifo), "--no-progress"))
    assert f"--prompts: {fifo}: it is a FIFO (named pipe), not a regular file" in err


@pytest.mark.slow
def test_dev_stdin_as_prompts_is_refused_as_the_pipe_it_is() -> None:
    result = kvwire("run", "--prompts", "/dev/stdin", "--no-progress", stdin=subprocess.PIPE)
    assert "--prompts: /dev/stdin: it is a FIFO (named pipe), not a regular file" in (
        refusal(result)
    )


def test_a_directory_as_prompts_is_refused_as_one(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", "--prompts", str(tmp_path), "--no-progress"]) == 2
    assert f"--prompts: {tmp_path}: it is a directory, not a regular file" in (
        capsys.readouterr().err
    )


@pytest.mark.slow
def test_a_prompts_file_over_the_bound_is_refused_by_its_size_without_reading_it(
    tmp_path: pathlib.Path,
) -> None:
    # Sparse: a terabyte of zeros that takes no disk; read, it would take all memory.
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("wb") as file:
        file.truncate(2**40)
    err = refusal(kvwire("run", "--prompts", str(prompts), "--no-progress"))
    assert (
        f"--prompts: {prompts}: it holds {2**40} bytes, more than the {MAX_PROMPTS_BYTES} "
        "accepted; a prompts file is a regular JSONL file"
    ) in err


@pytest.mark.slow
def test_a_prompts_file_of_too_many_lines_is_refused_before_any_request_runs(
    tmp_path: pathlib.Path,
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a question"}\n' * (MAX_PROMPTS_LINES + 1))
    err = refusal(kvwire("run", "--prompts", str(prompts), "--no-progress"))
    assert f"--prompts: {prompts}: more than {MAX_PROMPTS_LINES} lines" in err


def test_a_prompts_file_that_is_not_utf8_names_the_file_and_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    assert cli.main(["run", "--prompts", str(prompts), "--no-progress"]) == 2
    assert f"kvwire run: error: --prompts: {prompts}:2: not UTF-8 text (invalid continuation" in (
        capsys.readouterr().err
    )


def test_a_prompt_longer_than_the_models_max_model_len_names_its_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "short"}, {"prompt_token_ids": [7] * 2040, "max_tokens": 9}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # The embedded profile: max_model_len 2048.
    assert cli.main(["run", "--prompts", str(prompts), "--no-progress"]) == 2
    assert (
        f"--prompts: {prompts}:2: the prompt (2040 tokens) and max_tokens (9) exceed "
        "model_config.max_model_len (2048)"
    ) in capsys.readouterr().err


def test_a_prompt_field_given_twice_on_one_line_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "kept?", "prompt": "or this?"}\n')
    assert cli.main(["run", "--prompts", str(prompts), "--no-progress"]) == 2
    assert f"--prompts: {prompts}:1: the field 'prompt' appears twice in one object" in (
        capsys.readouterr().err
    )


def test_a_prompts_error_shows_no_unbounded_value(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a", "max_tokens": "9" * 100_000}) + "\n")
    assert cli.main(["run", "--prompts", str(prompts), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--prompts: {prompts}:1: max_tokens must be an int >= 1, got '999" in err
    assert len(err) < 1000


# ------------------------------------------------------------------- the flags


@pytest.mark.parametrize(
    ("flag", "value", "accepted"),
    [
        ("--requests", str(MAX_REQUESTS + 1), f"from 1 to {MAX_REQUESTS}"),
        ("--requests", "1e11", f"from 1 to {MAX_REQUESTS}"),
        ("--prompt-len", "100000000", f"from 1 to {2**24}"),
        ("--output-len", "0", f"from 1 to {2**24}"),
        ("--tensor-parallel-size", "9" * 5000, f"from 1 to {2**16}"),
        ("--seed", "9" * 5000, f"from {-(2**64)} to {2**64}"),
    ],
)
def test_a_count_no_run_can_hold_is_a_usage_error_naming_its_flag_and_the_range(
    flag: str, value: str, accepted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser(wants_run=True).parse_args(["run", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected a whole number {accepted}, got '{value[:10]}" in err
    # The value is shown bounded, however long it was.
    assert len(err) < 1500


def test_lengths_past_the_models_max_model_len_are_refused_naming_both_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = cli.main(["run", "--prompt-len", "2040", "--output-len", "9", "--no-progress"])
    assert status == 2
    assert (
        "kvwire run: error: --prompt-len (2040) + --output-len (9) exceeds "
        "model_config.max_model_len (2048)"
    ) in capsys.readouterr().err


@pytest.mark.slow
def test_a_workload_of_more_tokens_than_a_run_holds_is_refused_before_it_is_built(
    tmp_path: pathlib.Path,
) -> None:
    profile = tmp_path / "long.yaml"
    document = yaml.safe_load(shipped_profile_path(DEFAULT_PROFILE_NAME).read_text())
    document["model_config"]["max_model_len"] = 2**20
    profile.write_text(yaml.safe_dump(document))
    # 100,000 prompts of 100,000 tokens: ten billion tokens, built, would fill any memory.
    err = refusal(kvwire("run", str(profile), "--requests", "100000", "--prompt-len", "100000"))
    assert (
        "kvwire run: error: --requests (100000) x (--prompt-len + --output-len) is "
        f"10001600000 tokens, more than the {MAX_WORKLOAD_TOKENS} a run holds"
    ) in err


# -------------------------------------------------------- a connector's module


@pytest.mark.parametrize(
    ("module_path", "problem"),
    [
        ("os", "Class CPUOffloadConnector not found in os; expected a module defining"),
        (
            "no.such.mod",
            "cannot import 'no.such.mod': ModuleNotFoundError: No module named 'no'",
        ),
        (
            "tests.support.plugin_modules.exiting",
            "cannot import 'tests.support.plugin_modules.exiting': SystemExit: "
            "plugin settings from redis://u:***@h",
        ),
    ],
)
def test_a_bad_module_path_is_named_by_its_field_without_a_traceback(
    module_path: str, problem: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: CPUOffloadConnector\n"
        "  kv_role: kv_both\n"
        f"  kv_connector_module_path: {module_path}\n"
    )
    assert cli.main(["run", str(profile), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (
        f"kvwire run: {profile}: error: kv_transfer_config.kv_connector_module_path: {problem}"
        in err
    )
    assert "hunter2" not in err


def _in_a_terminal() -> None:
    # A shell's background job (a CI runner's, make's) may have SIGINT
    # ignored, which the child would inherit: give it the default back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _limited()


def _start_run(
    arguments: list[str],
    *,
    env: dict[str, str] | None = None,
    own_group: bool = False,
    program: tuple[str, ...] = ("-c", KVWIRE),
) -> subprocess.Popen[str]:
    """`kvwire run ARGUMENTS` as a terminal starts it; `own_group` to interrupt its workers too.

    `program`: Python's arguments that run the `kvwire` command.
    """
    return subprocess.Popen(
        [sys.executable, *program, "run", *arguments, "--no-progress"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
        preexec_fn=_in_a_terminal,
    )


def _wait_for(
    ready: pathlib.Path, process: subprocess.Popen[str], what: str, limit_s: float
) -> None:
    deadline = time.monotonic() + limit_s
    while not ready.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _interrupt_group(
    process: subprocess.Popen[str], *, when: Callable[[], None], timeout_s: float
) -> str:
    """Ctrl-C, as a terminal sends it to the whole group, once `when` returns; the stderr.

    The run must end at once; its group is killed whatever happens.
    """
    try:
        when()
        os.killpg(process.pid, signal.SIGINT)
        interrupted = time.monotonic()
        _out, err = process.communicate(timeout=timeout_s)
        # At once: nothing waits for a worker process to finish what it was doing.
        assert time.monotonic() - interrupted < 20
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    return err


def test_ctrl_c_stops_a_run_with_status_130_and_no_traceback(tmp_path: pathlib.Path) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: SlowConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_module_path: tests.support.plugin_modules.slow_importing\n"
    )
    ready = tmp_path / "ready"
    process = _start_run([str(profile)], env={**os.environ, "KVWIRE_TEST_READY": str(ready)})
    try:
        _wait_for(ready, process, "kvwire run never reached the module's import", 60)
        process.send_signal(signal.SIGINT)
        _out, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait(timeout=60)
    assert process.returncode == 130, err
    assert err.strip() == "kvwire: interrupted"


def test_a_connector_hook_that_raises_is_named_without_a_traceback(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: RaisingHMAHookConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_module_path: tests.support.connectors\n"
    )
    assert cli.main(["run", str(profile), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvwire run: {profile}: error: kv_transfer_config.kv_connector: RaisingHMAHookConnector."
        "supports_hma_for_config raised RuntimeError: lost redis://u:***@h\n"
    )


def test_an_unknown_preset_is_shown_cut_short(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--preset", "p" * 100_000, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is not one of tiny, bench" in err and "(a str of 100000 characters)" in err
    assert len(err) < 1000


def _children(pid: int) -> list[int]:
    children = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            # The parent's pid is the second field after the command's closing ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


SLOW_TO_IMPORT = (str(REPO / "tests/support/processes/kvwire_slow_to_import.py"),)
# A script's own folder starts sys.path: the tests' plug-in modules come from the repository.
WITH_TESTS = {**os.environ, "PYTHONPATH": str(REPO)}


def _profile_slow_in_worker_steps(tmp_path: pathlib.Path) -> str:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: SlowInWorkerStepsConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_module_path: tests.support.plugin_modules.slow_in_worker_steps\n"
    )
    return str(profile)


@pytest.mark.slow
def test_a_sigint_that_reaches_a_worker_process_while_it_imports_is_left_to_the_run(
    tmp_path: pathlib.Path,
) -> None:
    importing, stepping = tmp_path / "importing", tmp_path / "stepping"
    env = {
        **WITH_TESTS,
        "KVWIRE_TEST_WORKER_IMPORTING": str(importing),
        "KVWIRE_TEST_READY": str(stepping),
    }
    # Run from a script: the worker imports it again before any of kvwire's code runs there.
    arguments = [_profile_slow_in_worker_steps(tmp_path), "--worker-process"]
    process = _start_run(
        [*arguments, "--requests", "1", "--prompt-len", "16"],
        env=env,
        own_group=True,
        program=SLOW_TO_IMPORT,
    )
    try:
        _wait_for(importing, process, "the worker never imported the script", 120)
        # The part of a terminal's Ctrl-C that reaches the worker (and the resource
        # tracker), before the run acts on its own part.
        for child in _children(process.pid):
            os.kill(child, signal.SIGINT)
        (tmp_path / "importing-go-on").touch()
        _wait_for(stepping, process, "the run never reached its connector's steps", 120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        _out, err = process.communicate(timeout=60)
    assert "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_while_a_worker_process_imports_stops_the_run_with_status_130_and_no_traceback(
    tmp_path: pathlib.Path,
) -> None:
    importing = tmp_path / "importing"
    process = _start_run(
        ["--worker-process", "--requests", "1", "--prompt-len", "16"],
        env={**WITH_TESTS, "KVWIRE_TEST_WORKER_IMPORTING": str(importing)},
        own_group=True,
        program=SLOW_TO_IMPORT,
    )
    err = _interrupt_group(
        process,
        when=lambda: _wait_for(importing, process, "the worker never imported the script", 120),
        timeout_s=90,
    )
    assert process.returncode == 130, err
    assert err.splitlines()[-1] == "kvwire: interrupted"
    assert "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_while_a_worker_process_runs_a_step_stops_the_run_with_status_130_and_no_traceback(
    tmp_path: pathlib.Path,
) -> None:
    stepping = tmp_path / "stepping"
    arguments = [_profile_slow_in_worker_steps(tmp_path), "--worker-process", "--requests", "1"]
    process = _start_run(
        [*arguments, "--prompt-len", "16"],
        env={**os.environ, "KVWIRE_TEST_READY": str(stepping)},
        own_group=True,
    )
    err = _interrupt_group(
        process,
        when=lambda: _wait_for(stepping, process, "the worker process never ran a step", 120),
        timeout_s=60,
    )
    assert process.returncode == 130, err
    assert err.splitlines()[-1] == "kvwire: interrupted"
    assert "Traceback" not in err


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (an orphan that ended may stay a zombie a while)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.slow
def test_a_worker_process_ends_at_once_when_its_run_is_killed(tmp_path: pathlib.Path) -> None:
    stepping = tmp_path / "stepping"
    arguments = [_profile_slow_in_worker_steps(tmp_path), "--worker-process", "--requests", "1"]
    process = _start_run(
        [*arguments, "--prompt-len", "16"],
        env={**os.environ, "KVWIRE_TEST_READY": str(stepping)},
        own_group=True,
    )
    try:
        _wait_for(stepping, process, "the worker process never ran a step", 120)
        children = _children(process.pid)
        # The run alone, with no chance to stop its worker, which holds a step for a minute.
        process.kill()
        process.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(_running(child) for child in children):
            assert time.monotonic() < deadline, "a process the run started outlived it"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):  # every process of the group has ended
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)


def test_python_m_kvwire_run_is_kvwire_run_with_its_bounded_usage_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvwire.run import main as run_main

    with pytest.raises(SystemExit) as exit_info:
        run_main(["profile.yaml", "z" * 100_000])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: 'zzz" in err and len(err) < 1500


def test_a_connector_constructor_that_calls_sys_exit_is_its_error_not_the_runs_exit(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: ExitingConstructorConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_module_path: tests.support.connectors\n"
    )
    assert cli.main(["run", str(profile), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"kvwire run: {profile}: error: kv_transfer_config.kv_connector: "
        "ExitingConstructorConnector() raised SystemExit: lost redis://u:***@h\n"
    )


def test_a_composite_childs_bad_module_path_is_named_by_the_childs_field(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: MultiConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    connectors:\n"
        "    - {kv_connector: CPUOffloadConnector, kv_connector_extra_config: "
        "{cpu_pool_bytes: 1MiB}}\n"
        "    - {kv_connector: SharedStorageConnector, kv_connector_module_path: no.such.mod}\n"
    )
    assert cli.main(["run", str(profile), "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(
        f"kvwire run: {profile}: error: kv_transfer_config.kv_connector_extra_config.connectors[1]"
        ".kv_connector_module_path: cannot import 'no.such.mod': ModuleNotFoundError"
    )


@pytest.mark.slow
def test_ctrl_c_while_a_worker_process_starts_stops_it_at_once(tmp_path: pathlib.Path) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: SlowInWorkerConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_module_path: tests.support.plugin_modules.slow_in_worker\n"
    )
    ready = tmp_path / "ready"
    # A tiny workload: the connector's engine, and its worker, start at once.
    arguments = [str(profile), "--worker-process", "--requests", "1", "--prompt-len", "16"]
    process = _start_run(
        arguments, env={**os.environ, "KVWIRE_TEST_READY": str(ready)}, own_group=True
    )
    # The worker, still starting (and leaving SIGINT to its parent), is not waited for.
    err = _interrupt_group(
        process,
        when=lambda: _wait_for(ready, process, "the worker never imported the connector", 120),
        timeout_s=90,
    )
    assert process.returncode == 130, err
    assert err.splitlines()[-1] == "kvwire: interrupted"
    assert "Traceback" not in err
