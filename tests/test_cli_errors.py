"""The CLI's ordinary failures are one line, never a traceback: a log that cannot be written
(a full disk, a file-size limit), Ctrl-C, a reader that closed stdout (``| head``), a missing
vLLM. ``kvsched: error: ...`` exits 2; Ctrl-C exits 130; a closed stdout exits 141."""

from __future__ import annotations

import errno
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvsched.cli
import kvsched.integrations.vllm.models
import kvsched.replay.driver
import kvsched.replay.traces
from kvsched.events.log import read_log
from kvsched.replay.verify import verify_log

SRC = Path(kvsched.cli.__file__).parents[2]
CLI = [sys.executable, "-c", "import sys; from kvsched.cli import main; sys.exit(main())"]
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = kvsched.cli.main(list(argv))
    except KeyboardInterrupt as exc:  # not re-raised: pytest would end the whole session
        pytest.fail(f"KeyboardInterrupt escaped main: {exc!r}")
    out, err = capsys.readouterr()
    return code, out, err


def demo_log(capsys: pytest.CaptureFixture[str], path: Path, sessions: int = 4) -> Path:
    code, _, _ = run_cli(capsys, "demo", "--log", str(path), "--quiet", "--sessions", str(sessions))
    assert code == 0
    return path


def test_logging_to_a_full_device_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "demo", "--log", "/dev/full", "--quiet", "--sessions", "2")
    assert (code, out) == (2, "")
    assert err == "kvsched: error: cannot write event log /dev/full: No space left on device\n"


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_file_size_limit_while_logging_leaves_a_log_verifiable_to_its_last_step(
    tmp_path: Path,
) -> None:
    log = tmp_path / "run.kvlog"
    proc = subprocess.run(
        [*CLI, "demo", "--log", str(log), "--quiet", "--sessions", "4", "--turns", "2"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: _limit_file_size(40_000),
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    found = re.fullmatch(
        rf"kvsched: error: cannot write event log {re.escape(str(log))}: File too large; the log "
        r"is closed and verifiable up to its last complete step \((\d+) steps, (\d+) bytes\)",
        lines[0],
    )
    assert found is not None, lines[0]
    steps, size = int(found[1]), int(found[2])
    assert steps > 0 and size == log.stat().st_size <= 40_000
    contents = read_log(log)  # a clean prefix: complete records, no torn tail
    assert contents.torn_tail is None and len(contents.records) == steps
    result = verify_log(str(log))
    assert (result.steps, result.divergence, result.torn_tail) == (steps, None, None)


def test_ctrl_c_in_replay_says_how_many_steps_the_log_holds_and_exits_130(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = demo_log(capsys, tmp_path / "demo.kvlog")
    real, calls = kvsched.replay.driver.execute_step, []

    def execute_step(*args: object) -> float:
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kvsched.replay.driver, "execute_step", execute_step)
    out_log = tmp_path / "out.kvlog"
    code, out, err = run_cli(capsys, "replay", str(trace), "--log", str(out_log), "--quiet")
    assert (code, out) == (130, "")
    assert err == "kvsched: interrupted after 10 steps; the log holds 10 complete steps\n"
    result = verify_log(str(out_log))
    assert (result.steps, result.divergence, result.torn_tail) == (10, None, None)


@pytest.mark.slow
def test_a_real_sigint_in_replay_ends_with_one_line_and_a_log_that_verifies(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = demo_log(capsys, tmp_path / "demo.kvlog", sessions=64)
    out_log = tmp_path / "out.kvlog"
    proc = subprocess.Popen(
        [*CLI, "replay", str(trace), "--quiet", "--log", str(out_log)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not out_log.exists() or out_log.stat().st_size < 20_000:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out) == (130, ""), err
    found = re.fullmatch(r"kvsched: interrupted after (\d+) steps; the log holds (\d+) .*\n", err)
    assert found is not None, err
    result = verify_log(str(out_log))
    assert (result.divergence, result.torn_tail) == (None, None)
    assert result.steps == int(found[2]) >= int(found[1]) > 0


@pytest.mark.parametrize("command", ["replay", "diff"])
def test_a_reader_that_closed_stdout_ends_the_command_quietly_with_141(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    log = str(demo_log(capsys, tmp_path / "demo.kvlog", sessions=2))
    argv = [command, log, "--quiet"] if command == "replay" else [command, log, log]
    read, write = os.pipe()
    os.close(read)  # as `| head` after its lines: every write to stdout fails with EPIPE
    try:
        proc = subprocess.run(
            [*CLI, *argv], env=ENV, stdout=write, stderr=subprocess.PIPE, text=True, timeout=300
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_replay_piped_into_head_prints_no_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    log = demo_log(capsys, tmp_path / "demo.kvlog", sessions=2)
    cli = " ".join(f"'{a}'" for a in [*CLI, "replay", str(log), "--quiet"])
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {cli} | head -1"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stdout.startswith("kvsched replay: ")
    assert proc.returncode in (0, 141) and "Traceback" not in proc.stderr


def test_bench_vllm_without_vllm_says_how_to_get_it_before_writing_a_model(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as outside .venv-vllm
    built: list[str] = []

    def build(kind: str, path: object, seed: int = 0) -> Path:
        built.append(kind)
        return tmp_path

    monkeypatch.setattr(kvsched.integrations.vllm.models, "build", build)
    code, out, err = run_cli(capsys, "bench", "vllm", "--running", "2", "--samples", "1")
    assert (code, out, built) == (2, "", [])
    assert err.startswith("kvsched: error: kvsched bench vllm needs vLLM") and err.count("\n") == 1
    assert "scripts/vllm_env.sh" in err and ".venv-vllm/bin/kvsched" in err


def test_a_trace_that_cannot_be_read_is_one_error_line_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n')

    def denied(path: object, *args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(kvsched.replay.traces, "open", denied, raising=False)  # as chmod 000
    code, out, err = run_cli(capsys, "replay", str(trace), "--quiet")
    assert (code, out) == (2, "")
    assert err == f"kvsched: error: {trace}: Permission denied\n"
