"""The demo without the command line: ``run_demo`` returns the metrics of its chat workload,
reports progress through the callback it is given, and with ``external=True`` its second
engine loads from the store what the first one saved."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.replay.log_helpers import sampled

from kvsched.events.log import LogOpenError
from kvsched.replay.demo import demo_model, run_demo
from kvsched.replay.setup import SetupError
from kvsched.replay.verify import verify_log

TINY = {"sessions": 2, "turns": 2}


def test_the_demo_returns_the_metrics_of_its_chat_workload():
    demo = run_demo(**TINY)

    m = demo.metrics
    assert len(demo.workload.turns) == 4 and m["workload"] == "chat"
    assert m["requests"] == 4 and m["finished"] == 4 and m["ttft_p99_s"] > 0
    assert m["token_hit_rate"] > 0  # the second turn of a session hits the first one's KV
    assert demo.result.metrics["prefill_tokens"] == m["prefill_tokens"]


def test_a_pipelined_demo_serves_the_same_tokens_and_its_log_verifies(tmp_path: Path):
    log = tmp_path / "pipelined.log"
    sync = run_demo(**TINY)
    pipelined = run_demo(**TINY, pipelined=True, check=True, log=str(log))

    assert pipelined.metrics["generated_tokens"] == sync.metrics["generated_tokens"]
    assert pipelined.metrics["finished"] == 4
    result = verify_log(str(log))
    assert result.ok and result.steps == pipelined.metrics["steps"]


def test_the_external_demo_second_engine_loads_what_the_first_one_saved(tmp_path: Path):
    log = tmp_path / "b.kvlog"

    demo = run_demo(**TINY, external=True, log=str(log))

    m = demo.metrics
    assert m["external_hit_tokens"] > 0 and m["hit_rate_external"] > 0
    assert m["store_values"] > 0 and m["prefill_tokens"] < m["engine_a_prefill_tokens"]
    assert verify_log(log).ok  # the logged run is engine B's


def test_a_pipelined_external_demo_serves_the_synchronous_tokens_from_the_store(tmp_path: Path):
    """Overlapped steps with loads from the store (the tiny hybrid torch model: a load or a
    state read before it is written changes the tokens): engine B gives the synchronous
    engine B's tokens, one more at most past a sequence's end (dropped), and its log
    verifies."""
    kw = {"sessions": 1, "turns": 2, "external": True, "hybrid": True, "executor": "torch"}
    sync = run_demo(**kw, log=str(tmp_path / "sync.kvlog"))
    pipe = run_demo(**kw, pipelined=True, check=True, log=str(tmp_path / "pipe.kvlog"))

    assert pipe.metrics["external_hit_tokens"] > 0
    assert pipe.metrics["generated_tokens"] == sync.metrics["generated_tokens"]
    want = sampled(str(tmp_path / "sync.kvlog"))
    got = sampled(str(tmp_path / "pipe.kvlog"))
    assert want.keys() == got.keys()
    for seq, tokens in want.items():
        assert got[seq][: len(tokens)] == tokens and len(got[seq]) <= len(tokens) + 1, seq
    assert verify_log(tmp_path / "pipe.kvlog").ok


def test_the_demo_tells_its_progress_callback_each_run_and_the_requests_done():
    seen: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def progress(desc: str, total: int) -> Iterator[Callable[[int], None]]:
        seen[desc] = [total]
        yield seen[desc].append

    run_demo(**TINY, external=True, progress=progress)

    assert list(seen) == ["demo A", "demo B"]
    assert all(done[0] == 4 and done[-1] == 4 for done in seen.values())


def test_a_demo_log_that_cannot_be_written_fails_before_any_run(tmp_path: Path):
    seen: list[str] = []

    @contextlib.contextmanager
    def progress(desc: str, total: int) -> Iterator[None]:
        seen.append(desc)
        yield None

    with pytest.raises(LogOpenError, match="cannot write event log"):
        run_demo(**TINY, log=str(tmp_path / "missing" / "run.kvlog"), progress=progress)
    assert seen == []


def test_a_model_directory_without_a_config_is_a_setup_error_naming_it(tmp_path: Path):
    with pytest.raises(SetupError, match=r"--model .*nope: cannot read .*config\.json"):
        demo_model(str(tmp_path / "nope"), str(tmp_path))
