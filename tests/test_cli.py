"""``kvsched`` (src/kvsched/cli/): what a command writes never replaces a file unless asked
(and never its input), ``--report`` is checked before the first step and a failed report still
prints the run, options that would have no effect are refused, every default is in ``--help``
and ``verify``'s progress bar has a total."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

import pytest

import kvsched.cli
import kvsched.cli.logs
import kvsched.cli.output
from kvsched.cli import build_parser, main

EARLIER = b"an earlier run's results"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``kvsched ARGV``: (exit code, stdout, stderr); argparse's errors exit through SystemExit."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def demo(*extra: str) -> list[str]:
    return ["demo", "--sessions", "3", "--turns", "2", "--quiet", *extra]


def small_trace(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 100 * i, "input_length": 600 + 50 * i, "output_length": 3, "hash_ids": [0, i]}
        for i in range(6)
    ]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def azure_trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,480,10\n"
        "2023-11-16 18:17:04.0000000,100,2\n"
    )
    return path


def demo_log(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> Path:
    log = tmp_path / "a.kvlog"
    assert run(capsys, *demo("--log", str(log), *extra))[0] == 0
    return log


# ----------------------------------------------------------- 1. never replace a file


def test_demo_refuses_an_existing_log_without_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = tmp_path / "run.kvlog"
    log.write_bytes(EARLIER)
    code, out, err = run(capsys, *demo("--log", str(log)))
    assert code == 2 and out == ""
    assert err.startswith("kvsched: error: --log") and "--overwrite" in err
    assert log.read_bytes() == EARLIER


def test_demo_replaces_an_existing_log_with_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = tmp_path / "run.kvlog"
    log.write_bytes(EARLIER)
    assert run(capsys, *demo("--log", str(log), "--overwrite"))[0] == 0
    assert run(capsys, "verify", str(log), "--quiet")[0] == 0


@pytest.mark.parametrize("extra", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_replay_never_writes_its_log_over_its_input_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
):
    log = demo_log(tmp_path, capsys)
    before = log.read_bytes()
    code, _, err = run(capsys, "replay", str(log), "--log", str(log), "--quiet", *extra)
    assert code == 2 and "is the input" in err
    assert log.read_bytes() == before


@pytest.mark.parametrize("spelling", ["same", "relative", "symlink"])
def test_replay_never_turns_its_csv_trace_into_an_event_log(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    spelling: str,
):
    trace = azure_trace(tmp_path)
    before = trace.read_bytes()
    monkeypatch.chdir(tmp_path)
    out = {"same": str(trace), "relative": "./trace.csv", "symlink": "link.kvlog"}[spelling]
    if spelling == "symlink":
        os.symlink(trace, tmp_path / "link.kvlog")
    extra = [] if spelling == "same" else ["--overwrite"]  # (refused with it or not)
    code, _, err = run(capsys, "replay", str(trace), "--log", out, "--quiet", *extra)
    assert code == 2 and "is the input" in err
    assert trace.read_bytes() == before


def test_replay_refuses_an_existing_log_without_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = tmp_path / "out.kvlog"
    log.write_bytes(EARLIER)
    code, _, err = run(capsys, "replay", str(small_trace(tmp_path)), "--log", str(log), "--quiet")
    assert code == 2 and "--overwrite" in err and log.read_bytes() == EARLIER


def test_bench_step_refuses_an_existing_log_without_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = tmp_path / "step.kvlog"
    log.write_bytes(EARLIER)
    argv = ["bench", "step", "--running", "2", "--warmup", "0", "--samples", "1", "--json"]
    code, _, err = run(capsys, *argv, "--log", str(log))
    assert code == 2 and "--overwrite" in err and log.read_bytes() == EARLIER
    assert run(capsys, *argv, "--log", str(log), "--overwrite")[0] == 0
    assert log.read_bytes() != EARLIER


# ------------------------------------------------ 2. --report before the first step


def refused_before_any_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], report: Path, *extra: str
) -> str:
    """Run a demo with --log and --report; assert it failed before its first step (no log,
    no output, exit 2) and return its error."""
    log = tmp_path / "run.kvlog"
    code, out, err = run(capsys, *demo("--log", str(log), "--report", str(report), *extra))
    assert code == 2 and out == "" and not log.exists(), err
    assert err.startswith("kvsched: error: --report")
    return err


def test_report_without_matplotlib_fails_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    err = refused_before_any_step(tmp_path, capsys, tmp_path / "report")
    assert "matplotlib" in err and "kvsched[plots]" in err


def test_report_into_an_existing_file_fails_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    (tmp_path / "taken").write_bytes(EARLIER)
    err = refused_before_any_step(tmp_path, capsys, tmp_path / "taken", "--overwrite")
    assert "not a directory" in err
    assert (tmp_path / "taken").read_bytes() == EARLIER


def test_report_into_an_uncreatable_directory_fails_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    (tmp_path / "file").write_bytes(EARLIER)  # (root writes anywhere: a file as a parent)
    err = refused_before_any_step(tmp_path, capsys, tmp_path / "file" / "report")
    assert "cannot write there" in err


def test_report_into_a_non_empty_directory_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    report = tmp_path / "report"
    report.mkdir()
    (report / "metrics.json").write_bytes(EARLIER)
    assert "--overwrite" in refused_before_any_step(tmp_path, capsys, report)
    assert (report / "metrics.json").read_bytes() == EARLIER
    assert run(capsys, *demo("--report", str(report), "--overwrite"))[0] == 0
    assert json.loads((report / "metrics.json").read_text())["requests"] == 6


def test_the_report_check_leaves_no_directory_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    report = tmp_path / "new" / "deeper" / "report"
    code, _, err = run(capsys, *demo("--report", str(report), "--model", "x"))
    assert code == 2 and "--model" in err  # refused after the report's probe
    assert list(tmp_path.iterdir()) == []


def test_report_into_an_existing_empty_directory_needs_no_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    report = tmp_path / "report"
    report.mkdir()  # made ready by hand: nothing in it to lose
    code, _, err = run(capsys, *demo("--report", str(report)))
    assert code == 0, err
    assert json.loads((report / "metrics.json").read_text())["requests"] == 6


def test_a_replay_failing_after_the_report_probe_leaves_none_of_the_directories_it_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    (tmp_path / "bad.jsonl").write_text("not json\n")  # read after --report was probed
    report = tmp_path / "new" / "deeper" / "report"
    code, _, err = run(capsys, "replay", str(tmp_path / "bad.jsonl"), "--report", str(report))
    assert code == 2 and "bad.jsonl:1" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def failing_report(*args: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_report_that_fails_after_the_run_prints_the_summary_then_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(kvsched.cli.output, "write_report", failing_report)
    code, out, err = run(capsys, *demo("--report", str(tmp_path / "report"), "--json"))
    assert code == 2
    assert json.loads(out)["requests"] == 6  # the run's summary, then the error
    assert "cannot write the report" in err and "No space left" in err


def test_a_sweep_whose_report_fails_prints_every_run_then_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(kvsched.cli.output, "write_report", failing_report)
    trace = str(small_trace(tmp_path))
    argv = ["replay", trace, "--sweep", "cache-blocks=40,80", "--report", str(tmp_path / "r")]
    code, out, err = run(capsys, *argv, "--json", "--quiet")
    assert code == 2 and "cannot write the report" in err
    assert [r["sweep_value"] for r in json.loads(out)["runs"]] == [40, 80]


# ------------------------------------------------ 4. options that would have no effect


@pytest.mark.parametrize(
    "option",
    [
        ["--policies", "all"],
        ["--checkpoint-budget", "8"],
        ["--checkpoint-memory", "1GiB"],
        ["--checkpoint-policy", "lmdeploy"],
        ["--checkpoint-placement", "chunk_end"],
        ["--checkpoint-eviction", "lru"],
        ["--checkpoint-interval", "1024"],
        ["--sweep", "checkpoint-budget=4,8"],
    ],
    ids=lambda o: o[0].lstrip("-") if o[0] != "--sweep" else "sweep",
)
def test_checkpoint_options_without_hybrid_are_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: list[str]
):
    code, out, err = run(capsys, "replay", str(small_trace(tmp_path)), *option, "--quiet")
    assert code == 2 and out == ""
    assert option[0] in err and "--hybrid" in err


def test_checkpoint_options_on_a_hybrid_log_need_no_hybrid_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = demo_log(tmp_path, capsys, "--hybrid")
    code, _, err = run(capsys, "replay", str(log), "--checkpoint-budget", "8", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--prefill-turns", "short_only"], ("--prefill-turns", "--order ttft")),
        (["--short-turns", "2"], ("--short-turns", "--order ttft")),
        (["--long-order", "fifo"], ("--long-order", "--order ttft")),
        (["--order", "ttft", "--prefill-turns", "standard", "--short-turns", "2"],
         ("--short-turns", "--prefill-turns interleave")),
        (["--model", "m"], ("--model", "--executor torch")),
        (["--wait-subscribers", "1"], ("--wait-subscribers", "--publish")),
        (["--executor", "torch", "--model", "m", "--cost", "a=1"], ("--cost", "--executor torch")),
        (["--cache-blocks", "40", "--sweep", "cache-blocks=40,80"],
         ("--cache-blocks", "--sweep cache-blocks")),
        (["--hybrid", "--checkpoint-budget", "4", "--checkpoint-memory", "1GiB"],
         ("--checkpoint-budget", "--checkpoint-memory")),
        (["--hybrid", "--checkpoint-memory", "1GiB", "--sweep", "checkpoint-budget=4,8"],
         ("--checkpoint-budget", "--checkpoint-memory")),
        (["--hybrid", "--policies", "all", "--checkpoint-policy", "sglang"],
         ("--policies", "--checkpoint-policy")),
        (["--hybrid", "--policies", "all", "--checkpoint-eviction", "lru"],
         ("--policies", "--checkpoint-eviction")),
    ],
    ids=lambda v: "+".join(a for a in v if a.startswith("--")) if isinstance(v, list) else "",
)  # fmt: skip
def test_replay_options_that_another_option_overrides_or_ignores_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: tuple[str, str]
):
    code, out, err = run(capsys, "replay", str(small_trace(tmp_path)), *argv, "--quiet")
    assert code == 2 and out == "" and err.startswith("kvsched: error:")
    assert named[0] in err and named[1] in err, err


def test_a_checkpoint_memory_sweep_with_a_checkpoint_budget_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    argv = ["--hybrid", "--checkpoint-budget", "4", "--sweep", "checkpoint-memory=1GiB,2GiB"]
    code, out, err = run(capsys, "replay", str(small_trace(tmp_path)), *argv, "--quiet")
    assert code == 2 and out == ""
    assert "--checkpoint-budget" in err and "--checkpoint-memory" in err, err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model", "m"], "--executor torch"),
        (["--wait-subscribers", "1"], "--publish"),
    ],
)
def test_demo_options_that_would_be_ignored_are_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
):
    code, out, err = run(capsys, *demo(*argv))
    assert code == 2 and out == "" and argv[0] in err and named in err


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser, recursively."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += parsers(sub)
    return found


def test_every_option_with_a_default_shows_it_in_help():
    missing = []
    for parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            shown = formatter._expand_help(action) if action.help else ""
            if f"default: {action.default}" not in shown:
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert not missing, missing


def test_demo_help_shows_its_defaults(capsys: pytest.CaptureFixture[str]):
    code, out, _ = run(capsys, "demo", "--help")
    text = " ".join(out.split())
    assert code == 0
    for shown in ("sessions (default: 64)", "session (default: 4)", "seed (default: 0)"):
        assert shown in text, shown
    for shown in ("blocks (default: 2048)", "sequences (default: 64)", "(default: sim)"):
        assert shown in text, shown


# ------------------------------------------------------------------ progress totals


def test_verify_progress_bar_shows_the_number_of_steps_as_its_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = demo_log(tmp_path, capsys)
    code, out, err = run(capsys, "verify", str(log))
    steps = int(out.split()[0])
    assert code == 0 and f"{steps}/{steps}" in err


def test_the_record_count_stops_at_a_torn_tail_and_at_trailing_zeros(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = demo_log(tmp_path, capsys)
    steps = int(run(capsys, "verify", str(log), "--quiet")[1].split()[0])
    assert kvsched.cli.logs.count_records(str(log)) == steps
    with log.open("ab") as f:
        f.write(bytes(4096))
    assert kvsched.cli.logs.count_records(str(log)) == steps
    log.write_bytes(log.read_bytes()[: -4096 - 3])
    assert kvsched.cli.logs.count_records(str(log)) == steps - 1
    assert kvsched.cli.logs.count_records(str(tmp_path / "missing")) is None
