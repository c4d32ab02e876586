"""`kvwire replay`: its output, its exit statuses and its error texts."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import attrs
import pytest

from kvwire import cli
from kvwire.replay.synthetic import SHAPES, TraceShape, generate_requests
from kvwire.replay.trace import read_trace

GOOD = {"timestamp": 0, "input_length": 32, "output_length": 8, "hash_ids": [1, 2]}


@pytest.fixture
def trace(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "t.jsonl"
    assert cli.main(["replay", "--generate", str(path), "--requests", "300", "--seed", "4"]) == 0
    return path


def test_generate_writes_a_trace_that_replays(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "generated.jsonl"
    assert cli.main(["replay", "--generate", str(trace), "--requests", "300", "--seed", "4"]) == 0
    assert capsys.readouterr().out == (
        f"kvwire replay: wrote 300 requests ({_accesses(trace)} block accesses, "
        f"{_distinct(trace)} distinct blocks) to {trace}\n"
    )
    assert cli.main(["replay", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"300 requests, {_accesses(trace)} block accesses, {_distinct(trace)} distinct blocks\n"
    )
    # The default: 4 fractions of the distinct blocks, 4 policies, 2 save thresholds.
    rows = [line.split() for line in out.splitlines()[3:35]]
    assert [row[0] for row in rows] == [
        str(round(fraction * _distinct(trace)))
        for fraction in (0.01, 0.02, 0.05, 0.1)
        for _ in range(8)
    ]
    assert {(row[1], row[2]) for row in rows} == {
        (policy, threshold) for policy in ("lru", "s3fifo", "arc", "kvfifo") for threshold in "12"
    }


@pytest.mark.parametrize("shape", ["mixed", "conversation", "agent", "rag"])
def test_generate_writes_the_shape_named(tmp_path: pathlib.Path, shape: str) -> None:
    path = tmp_path / f"{shape}.jsonl"
    arguments = ["replay", "--generate", str(path), "--shape", shape, "--requests", "50"]
    assert cli.main([*arguments, "--seed", "9"]) == 0
    expected = generate_requests(attrs.evolve(SHAPES[shape], requests=50, seed=9))
    assert read_trace(path) == expected


def test_generate_without_a_shape_writes_the_tiers_benchmark_s(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "default.jsonl"
    assert cli.main(["replay", "--generate", str(path), "--requests", "40"]) == 0
    assert read_trace(path) == generate_requests(TraceShape(requests=40))


def test_json_prints_one_object_per_configuration(
    trace: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    arguments = ["replay", str(trace), "--json", "--bytes", "64MiB,32MiB", "--block-bytes", "1MiB"]
    assert cli.main([*arguments, "--policies", "lru,arc,lru", "--save-thresholds", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["pool_blocks"], row["policy"], row["save_threshold"]) for row in rows] == [
        (32, "lru", 2),
        (32, "arc", 2),
        (64, "lru", 2),
        (64, "arc", 2),
    ]
    for row in rows:
        assert {
            "policy",
            "save_threshold",
            "pool_blocks",
            "hit_rate",
            "belady_hit_rate",
            "ratio",
            "blocks_written",
        } <= set(row)
        assert row["ratio"] == pytest.approx(row["hit_rate"] / row["belady_hit_rate"])
        assert 0 < row["blocks_written"] <= _accesses(trace)


def test_plot_draws_a_png(trace: pathlib.Path, tmp_path: pathlib.Path) -> None:
    plot = tmp_path / "curve.png"
    assert cli.main(["replay", str(trace), "--blocks", "8,16", "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_plot_without_matplotlib_names_the_extra(
    trace: pathlib.Path,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    arguments = ["replay", str(trace), "--blocks", "8", "--plot", str(tmp_path / "c.png")]
    assert cli.main(arguments) == 2
    assert capsys.readouterr().err == (
        "kvwire replay: error: kvwire replay --plot needs matplotlib, which is not installed: "
        "pip install 'kvwire[bench]'\n"
    )


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ([], "give a trace to replay (TRACE.jsonl), or --generate OUT.jsonl to write one"),
        (["{trace}", "--bytes", "1GiB"], "--bytes and --block-bytes go together: "),
        (["{trace}", "--requests", "5"], "--requests applies to --generate only"),
        (["{trace}", "--shape", "rag"], "--shape applies to --generate only"),
        (
            ["--generate", "{out}", "--jobs", "2"],
            "--generate writes a trace and replays nothing, so --jobs does not apply; ",
        ),
        (
            ["{trace}", "--generate", "{out}"],
            "--generate writes a trace and replays nothing, so TRACE.jsonl does not apply; ",
        ),
        (
            ["{trace}", "--policies", "lru,mru"],
            "--policies: unknown eviction policy 'mru'; expected one of lru, s3fifo, arc, kvfifo",
        ),
        (
            ["{trace}", "--bytes", "1MiB", "--block-bytes", "2MiB"],
            "--bytes: 1048576 bytes hold 0 blocks of 2097152 bytes; a pool holds 1 to ",
        ),
        (["{bad}"], "{bad}:2: input_length must be a whole number of tokens from 0 to "),
        (["{out}"], "{out}: cannot read it: No such file or directory"),
    ],
)
def test_a_refusal_is_one_line_with_status_2(
    trace: pathlib.Path,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    arguments: list[str],
    expected: str,
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "input_length": -5}) + "\n")
    names = {"trace": trace, "bad": bad, "out": tmp_path / "absent.jsonl"}
    capsys.readouterr()
    assert cli.main(["replay", *(argument.format(**names) for argument in arguments)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvwire replay: error: {expected.format(**names)}")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--fractions", "0"], "argument --fractions: expected a fraction above 0, at most 1"),
        (["--blocks", "4,x"], "argument --blocks: expected a whole number from 1 to "),
        (["--blocks", "4", "--fractions", "0.5"], "not allowed with argument --blocks"),
        (["--block-bytes", "lots"], "argument --block-bytes: expected a size in bytes"),
        (["--jobs", "0"], "argument --jobs: expected a whole number from 1 to 64, got '0'"),
        (
            ["--shape", "chat"],
            "argument --shape: expected a trace shape's name (mixed, conversation, agent, rag), "
            "got 'chat'",
        ),
    ],
)
def test_a_bad_option_is_a_usage_error(
    trace: pathlib.Path, capsys: pytest.CaptureFixture[str], arguments: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["replay", str(trace), *arguments])
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def test_replay_is_imported_only_when_it_is_the_command_and_needs_no_torch(
    tmp_path: pathlib.Path,
) -> None:
    probe = (
        "import sys\n"
        "from kvwire.cli import main\n"
        "main(['profiles'])\n"
        "print('kvwire.replay' in sys.modules)\n"
        f"main(['replay', '--generate', {str(tmp_path / 't.jsonl')!r}, '--requests', '20'])\n"
        f"main(['replay', {str(tmp_path / 't.jsonl')!r}, '--blocks', '4'])\n"
        "print('kvwire.replay' in sys.modules, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    lines = result.stdout.splitlines()
    assert "False" in lines
    assert lines[-1] == "True False"


def _lines(trace: pathlib.Path) -> list[dict[str, list[int]]]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


def _accesses(trace: pathlib.Path) -> int:
    return sum(len(line["hash_ids"]) for line in _lines(trace))


def _distinct(trace: pathlib.Path) -> int:
    return len({block for line in _lines(trace) for block in line["hash_ids"]})


def test_jobs_replays_in_worker_processes_the_same_table(
    trace: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    arguments = ["replay", str(trace), "--blocks", "16,64", "--policies", "lru,kvfifo"]
    assert cli.main([*arguments, "--jobs", "1"]) == 0
    alone = capsys.readouterr().out
    assert cli.main([*arguments, "--jobs", "2"]) == 0
    assert capsys.readouterr().out == alone
