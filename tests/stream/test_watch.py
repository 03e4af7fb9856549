"""Across processes: ``kvsched demo --publish`` (and ``replay --publish``) stream a run over
ZeroMQ on loopback; ``kvsched watch`` in another process rebuilds the cache from the stream
alone, and its view equals the engine's own state at the end of the run (rebuilt from the
run's event log)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvsched.cli import main
from kvsched.config import SchedulerConfig
from kvsched.engine import Engine
from kvsched.events.codec import decode_record
from kvsched.events.log import read_log
from kvsched.stream import engine_view


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def start_watch(endpoint: str, dump: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvsched.cli", "watch", endpoint, "--dump", str(dump)]
    return subprocess.Popen(
        [*cmd, "--timeout", "60", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def final_state_of(log: Path) -> dict[str, object]:
    """The engine's cache at the end of a logged run: the log replayed through an engine."""
    contents = read_log(log)
    engine = Engine(SchedulerConfig.from_dict(contents.header["config"]))
    for payload in contents.records:
        record = decode_record(payload)
        engine.step(record.inputs, record.clock)
    return engine_view(engine.state)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.mark.parametrize(
    "extra", [[], ["--hybrid"], ["--external"]], ids=["attention", "hybrid", "external"]
)
def test_watch_in_another_process_rebuilds_the_cache_of_a_published_demo(
    tmp_path: Path, extra: list[str]
):
    endpoint, dump, log = free_endpoint(), tmp_path / "view.json", tmp_path / "run.kvlog"
    proc = start_watch(endpoint, dump, "--every", "50")
    args = ["demo", "--sessions", "6", "--turns", "2", "--cache-blocks", "120", "--quiet"]
    args += ["--publish", endpoint, "--wait-subscribers", "1", "--log", str(log), "--json"]
    assert main([*args, *extra]) == 0  # (--external: the second engine's run is published)
    code, out, err = finish(proc)
    assert code == 0, err
    assert "followed completely" in out and "step" in out.splitlines()[0]
    watched = json.loads(dump.read_text())
    assert watched["summary"]["complete"] and not watched["summary"]["gaps"]
    assert watched["summary"]["records"] == len(read_log(log).records)
    actual = final_state_of(log)
    for part in ("prefix", "parents", "checkpoints", "seqs"):
        assert watched["view"][part] == actual[part], part
    assert watched["view"]["prefix"]  # the run left cached blocks to compare


def test_watch_of_a_published_trace_replay_reports_a_complete_view(tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        f'{{"timestamp": {i * 100}, "input_length": {1100 + 7 * i}, "output_length": 5, '
        f'"hash_ids": [0, 1, {10 + i}]}}'
        for i in range(30)
    ]
    trace.write_text("\n".join(rows) + "\n")
    endpoint, dump, log = free_endpoint(), tmp_path / "view.json", tmp_path / "run.kvlog"
    proc = start_watch(endpoint, dump, "--json")
    args = ["replay", str(trace), "--block-size", "128", "--cache-blocks", "60", "--quiet"]
    assert main([*args, "--publish", endpoint, "--wait-subscribers", "1", "--log", str(log)]) == 0
    code, out, err = finish(proc)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["complete"] and summary["finished"] == 30
    assert json.loads(dump.read_text())["view"]["prefix"] == final_state_of(log)["prefix"]


def test_watch_with_no_publisher_gives_up_after_its_timeout_and_exits_1(tmp_path: Path):
    code = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "watch", free_endpoint(), "--timeout", "0.3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert code.returncode == 1
    assert "kvsched: error:" in code.stderr


def test_publishing_on_a_busy_endpoint_fails_before_any_work_with_exit_2(
    capsys: pytest.CaptureFixture[str],
):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        assert main(["demo", "--sessions", "1", "--quiet", "--publish", endpoint]) == 2
    assert "cannot bind publisher" in capsys.readouterr().err
