"""Across processes: ``kvsched demo --publish`` (and ``replay --publish``) stream a run over
ZeroMQ on loopback; ``kvsched watch`` in another process rebuilds the cache from the stream
alone, and its view equals the engine's own state at the end of the run (rebuilt from the
run's event log)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

import kvsched.stream.watch
from kvsched.cli import main
from kvsched.config import SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.events.codec import decode_record
from kvsched.events.log import read_log
from kvsched.events.wire import Message, WireTimeout
from kvsched.stream import CacheView, engine_view
from kvsched.stream.watch import summary_line


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


def test_watch_with_no_publisher_stops_after_its_timeout_with_its_final_line_and_dump(
    tmp_path: Path,
):
    dump = tmp_path / "view.json"
    argv = ["watch", free_endpoint(), "--timeout", "0.3", "--dump", str(dump)]
    code = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert code.returncode == 1, code.stderr
    assert code.stdout.startswith("final step") and "within 0.3 s" in code.stdout
    assert json.loads(dump.read_text())["summary"]["records"] == 0


class FakeSubscriber:
    """A stream of the messages a publisher of ``log``'s run sends, its first ``steps`` steps,
    after which receiving raises ``stop`` (Ctrl-C, or the timeout of a dead publisher)."""

    def __init__(self, log: Path, steps: int, stop: BaseException) -> None:
        contents = read_log(log)
        header = Message("header", 0, msgspec.msgpack.encode(contents.header))
        records = contents.records[:steps]
        self.messages = [header, *(Message("step", i, r) for i, r in enumerate(records))]
        self.stop = stop
        self.gaps: list[tuple[int, int]] = []

    def __call__(self, endpoint: str, *, timeout_s: float | None = None) -> FakeSubscriber:
        return self

    def __enter__(self) -> FakeSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __iter__(self) -> Iterator[Message]:
        yield from self.messages
        raise self.stop


@pytest.mark.parametrize(
    ("stop", "said"),
    [(KeyboardInterrupt(), "interrupted"), (WireTimeout("no message within 30 s"), "30 s")],
    ids=["ctrl-c", "publisher-died"],
)
def test_a_watch_stopped_early_prints_its_final_line_and_writes_its_dump(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stop: BaseException,
    said: str,
):
    log, dump = tmp_path / "run.kvlog", tmp_path / "view.json"
    assert main(["demo", "--sessions", "4", "--turns", "2", "--quiet", "--log", str(log)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(kvsched.stream.watch, "Subscriber", FakeSubscriber(log, 30, stop))
    code = main(["watch", "tcp://127.0.0.1:1", "--every", "10", "--dump", str(dump)])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[-2].startswith("final step      30") and said in out[-1]
    assert len([line for line in out if line.startswith("step")]) == 3
    summary = json.loads(dump.read_text())["summary"]
    assert summary["records"] == 30 and not summary["complete"] and said in summary["stopped"]


def test_ctrl_c_ends_a_watch_process_with_its_final_line_and_dump(tmp_path: Path):
    dump = tmp_path / "view.json"
    proc = start_watch(free_endpoint(), dump)
    assert proc.stderr is not None
    assert "Ctrl-C to stop" in proc.stderr.readline()  # it is subscribed (or about to be)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 1 and "Traceback" not in err
    assert out.startswith("final step") and "interrupted (Ctrl-C)" in out
    assert json.loads(dump.read_text())["summary"]["stopped"] == "interrupted"


def test_watch_refuses_an_existing_dump_without_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    dump = tmp_path / "view.json"
    dump.write_text("an earlier view")
    assert main(["watch", free_endpoint(), "--timeout", "0.1", "--dump", str(dump)]) == 2
    assert "--overwrite" in capsys.readouterr().err and dump.read_text() == "an earlier view"
    argv = ["watch", free_endpoint(), "--timeout", "0.1", "--dump", str(dump), "--overwrite"]
    assert main(argv) == 1
    assert json.loads(dump.read_text())["summary"]["records"] == 0


def test_watch_refuses_every_with_json(capsys: pytest.CaptureFixture[str]):
    assert main(["watch", free_endpoint(), "--json", "--every", "5"]) == 2
    assert "--every" in capsys.readouterr().err


def test_publishing_on_a_busy_endpoint_fails_before_any_work_with_exit_2(
    capsys: pytest.CaptureFixture[str],
):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        assert main(["demo", "--sessions", "1", "--quiet", "--publish", endpoint]) == 2
    assert "cannot bind publisher" in capsys.readouterr().err


def test_the_live_line_shows_the_stored_checkpoints_and_how_many_were_evicted():
    view = CacheView()
    for ckpt_id in (1, 2, 3):
        view.apply(ev.CheckpointReserved(ckpt_id, 1, ckpt_id, 64 * ckpt_id, bytes([ckpt_id]), b""))
        view.apply(ev.CheckpointPublished(ckpt_id))
    view.apply(ev.CheckpointEvicted(1))

    assert "checkpoints     2 (1 evicted)  " in summary_line(view.summary())
