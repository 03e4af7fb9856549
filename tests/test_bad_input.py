"""Invalid requests are rejected with a reason and change nothing else; bad CLI log paths."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import pytest

import kvsched.cli
import kvsched.replay.demo
import kvsched.replay.runs
from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, StepResult, create_log
from kvsched.events import types as ev
from kvsched.events.codec import encode
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.verify import verify_log

VOCAB = 500
MAX_CONTEXT = 256
CONFIG = SchedulerConfig(
    model=ModelSpec(vocab_size=VOCAB, max_context=MAX_CONTEXT),
    block_size=16,
    num_blocks=16,  # 15 usable blocks: at most 239 prompt tokens (one slot for an output)
    max_batch=8,
    max_prefill_tokens=64,
)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, n, dtype=np.int32)


def request(
    seq_id: int, n_prompt: int = 24, max_tokens: int = 6, **kw: object
) -> ev.RequestArrived:
    return ev.RequestArrived(seq_id, tokens(n_prompt, seq_id), max_tokens, **kw)  # type: ignore[arg-type]


def fingerprint(engine: Engine) -> tuple[object, ...]:
    """Everything the engine state holds (statistics without ``requests_rejected``)."""
    s = engine.state
    stats = attrs.asdict(s.stats)
    del stats["requests_rejected"]
    return (s.snapshot()[:-1], stats)


def encoded(decisions: tuple[ev.Event, ...] | list[ev.Event]) -> list[bytes]:
    return [encode(d) for d in decisions]


def finish_all(engine: Engine, outcome: list[ev.Event], clock: float) -> list[StepResult]:
    executor = SimulatedExecutor(VOCAB)
    results = []
    for _ in range(500):
        if not outcome and not engine.has_work:
            return results
        result = engine.step(outcome, clock)
        results.append(result)
        outcome = [] if result.plan.is_empty else [executor.execute(result.plan)]
        clock += 1.0
    raise AssertionError("engine still busy after 500 steps")


def finished_ids(results: list[StepResult]) -> set[int]:
    return {
        s
        for r in results
        for d in r.decisions
        if isinstance(d, ev.SequenceFinished)
        for s in d.seq_ids.tolist()
    }


BAD_REQUESTS: dict[str, tuple[Callable[[], ev.RequestArrived], str]] = {
    "empty prompt": (
        lambda: ev.RequestArrived(10, np.zeros(0, np.int32), 4),
        "empty prompt",
    ),
    "max_tokens zero": (lambda: request(10, max_tokens=0), "max_tokens must be positive"),
    "max_tokens negative": (lambda: request(10, max_tokens=-3), "max_tokens must be positive"),
    "duplicate id of a running request": (lambda: request(0), "duplicate"),
    "duplicate id of a request that arrived this step": (lambda: request(2), "duplicate"),
    "negative token id": (
        lambda: ev.RequestArrived(10, np.array([5, -1, 7], np.int32), 4),
        "outside the vocabulary",
    ),
    "token id equal to vocab_size": (
        lambda: ev.RequestArrived(10, np.array([5, VOCAB, 7], np.int32), 4),
        "outside the vocabulary",
    ),
    "token id far above vocab_size": (
        lambda: ev.RequestArrived(10, np.array([2**31 - 1], np.int32), 4),
        "outside the vocabulary",
    ),
    "prompt longer than the maximum context": (
        lambda: request(10, n_prompt=MAX_CONTEXT + 1),
        "exceeds the maximum context",
    ),
    "prompt filling the whole context (no room for an output)": (
        lambda: request(10, n_prompt=MAX_CONTEXT),
        "exceeds the maximum context",
    ),
    "prompt needing more KV blocks than the cache has": (
        lambda: request(10, n_prompt=15 * 16),
        "needs more KV blocks than the cache has",
    ),
    "multimodal span past the prompt end": (
        lambda: request(10, n_prompt=8, mm_spans=(ev.MultimodalSpan(4, 9, b"img"),)),
        "outside the prompt",
    ),
    "empty multimodal span": (
        lambda: request(10, n_prompt=8, mm_spans=(ev.MultimodalSpan(3, 3, b"img"),)),
        "outside the prompt",
    ),
    "invalid request opening a new session": (
        lambda: ev.RequestArrived(10, np.zeros(0, np.int32), 4, session_id=9),
        "empty prompt",
    ),
    "second turn while the session's turn is live": (
        lambda: request(10, session_id=5),
        "already has a request in flight",
    ),
}


def warm_engine() -> tuple[Engine, list[ev.Event]]:
    """An engine with requests 0 (session 5) and 1 running; returns it and step 1's outcome."""
    engine = Engine(CONFIG, check_invariants=True)
    result = engine.step([request(0, session_id=5), request(1, n_prompt=100)], 0.0)
    return engine, [SimulatedExecutor(VOCAB).execute(result.plan)]


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_an_invalid_request_is_rejected_with_its_reason_and_changes_nothing_else(case: str):
    make_bad, reason = BAD_REQUESTS[case]
    bad = make_bad()
    with_bad, outcome = warm_engine()
    without, _ = warm_engine()
    assert fingerprint(with_bad) == fingerprint(without)

    # Step 2: the outcome of step 1, a valid request 2, the bad request, then valid request 3.
    got = with_bad.step([*outcome, request(2), bad, request(3)], 1.0)
    ref = without.step([*outcome, request(2), request(3)], 1.0)

    rejections = [d for d in got.decisions if isinstance(d, ev.RequestRejected)]
    assert len(rejections) == 1
    assert rejections[0].seq_id == bad.seq_id
    assert reason in rejections[0].reason
    others = [d for d in got.decisions if not isinstance(d, ev.RequestRejected)]
    assert encoded(others) == encoded(ref.decisions)
    assert fingerprint(with_bad) == fingerprint(without)
    assert with_bad.state.stats.requests_rejected == without.state.stats.requests_rejected + 1

    # The engine keeps serving everyone else, exactly as if the bad request never came.
    executor = SimulatedExecutor(VOCAB)
    rest = finish_all(with_bad, [executor.execute(got.plan)], 2.0)
    rest_ref = finish_all(without, [executor.execute(ref.plan)], 2.0)
    assert finished_ids(rest) == {0, 1, 2, 3}
    assert [encoded(r.decisions) for r in rest] == [encoded(r.decisions) for r in rest_ref]
    assert fingerprint(with_bad) == fingerprint(without)


def test_the_largest_prompt_the_cache_can_hold_is_accepted_and_served():
    engine = Engine(CONFIG, check_invariants=True)
    result = engine.step([request(4, n_prompt=15 * 16 - 1, max_tokens=1)], 0.0)

    assert not any(isinstance(d, ev.RequestRejected) for d in result.decisions)
    rest = finish_all(engine, [SimulatedExecutor(VOCAB).execute(result.plan)], 1.0)
    assert finished_ids(rest) == {4}


def test_an_idle_engine_given_only_an_invalid_request_decides_nothing_but_the_rejection():
    engine = Engine(CONFIG, check_invariants=True)
    result = engine.step([ev.RequestArrived(4, np.zeros(0, np.int32), 4)], 0.0)

    assert encoded(result.decisions) == encoded(
        [ev.StepStarted(1, 0.0), ev.RequestRejected(4, "empty prompt")]
    )
    assert result.plan.is_empty
    assert not engine.has_work
    assert engine.state.seqs.seqs == {}


def test_a_rejected_request_id_is_not_reserved_by_the_rejection():
    engine = Engine(CONFIG, check_invariants=True)
    engine.step([request(4, max_tokens=0)], 0.0)
    result = engine.step([request(4, max_tokens=2)], 1.0)

    assert not any(isinstance(d, ev.RequestRejected) for d in result.decisions)
    rest = finish_all(engine, [SimulatedExecutor(VOCAB).execute(result.plan)], 2.0)
    assert finished_ids(rest) == {4}


def test_rejections_are_recorded_in_the_log_and_replay_without_divergence():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bad.kvlog")
        log = create_log(path, CONFIG)
        engine = Engine(CONFIG, log=log)
        bad = [make() for make, _ in BAD_REQUESTS.values()]
        first = engine.step([request(0, session_id=5), request(1), request(2)], 0.0)
        results = finish_all(engine, [SimulatedExecutor(VOCAB).execute(first.plan), *bad], 1.0)
        log.close()
        result = verify_log(path)

    rejected = [d for r in results for d in r.decisions if isinstance(d, ev.RequestRejected)]
    assert len(rejected) == len(bad)
    assert result.ok and result.torn_tail is None
    assert result.steps == 1 + len(results)


# ---------------------------------------------------------------------------- CLI


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any work the demo would start (building the workload or engine) fail loudly."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started working before checking its log path")

    monkeypatch.setattr(kvsched.replay.demo, "chat_workload", forbidden)
    monkeypatch.setattr(kvsched.replay.demo, "Engine", forbidden)
    monkeypatch.setattr(kvsched.replay.runs, "run", forbidden)


DEMO_ARGS = ["--sessions", "2", "--turns", "1", "--quiet"]


def test_demo_log_in_a_missing_directory_fails_with_exit_code_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
):
    path = tmp_path / "missing" / "run.kvlog"

    code = kvsched.cli.main(["demo", "--log", str(path), *DEMO_ARGS])

    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("kvsched: error: cannot write event log")
    assert str(path) in err and "No such file or directory" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_demo_log_at_a_directory_path_fails_with_exit_code_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
):
    target = tmp_path / "logs"
    target.mkdir()

    code = kvsched.cli.main(["demo", "--log", str(target), *DEMO_ARGS])

    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("kvsched: error: cannot write event log")
    assert str(target) in err and "Is a directory" in err
    assert target.is_dir() and list(target.iterdir()) == []
    assert list(tmp_path.iterdir()) == [target]


# ---------------------------------------------------------- numeric command-line options

# (command line, option, a value outside its range): every numeric option of every command
NUMERIC_OPTIONS = [
    (["demo"], "--sessions", "-3"),
    (["demo"], "--sessions", "0"),
    (["demo"], "--turns", "0"),
    (["demo"], "--seed", "-1"),
    (["demo"], "--cache-blocks", "1"),
    (["demo"], "--max-batch", "0"),
    (["demo"], "--wait-subscribers", "-1"),
    (["replay", "t.jsonl"], "--cache-blocks", "0"),
    (["replay", "t.jsonl"], "--block-size", "0"),
    (["replay", "t.jsonl"], "--max-batch", "-2"),
    (["replay", "t.jsonl"], "--max-prefill-tokens", "0"),
    (["replay", "t.jsonl"], "--checkpoint-budget", "-1"),
    (["replay", "t.jsonl"], "--checkpoint-interval", "0"),
    (["replay", "t.jsonl"], "--limit", "0"),
    (["replay", "t.jsonl"], "--speedup", "-2"),
    (["replay", "t.jsonl"], "--speedup", "nan"),
    (["replay", "t.jsonl"], "--wait-subscribers", "-5"),
    (["watch", "tcp://127.0.0.1:1"], "--every", "0"),
    (["watch", "tcp://127.0.0.1:1"], "--timeout", "0"),
    (["bench", "match"], "--batch", "0"),
    (["bench", "match"], "--context", "-1"),
    (["bench", "match"], "--block-size", "0"),
    (["bench", "match"], "--warmup", "-1"),
    (["bench", "match"], "--samples", "0"),
    (["bench", "step"], "--running", "0"),
    (["bench", "step"], "--samples", "-4"),
    (["bench", "vllm"], "--running", "0"),
    (["bench", "vllm"], "--rounds", "0"),
    (["demo"], "--sessions", "many"),
]


@pytest.mark.parametrize(
    ("command", "option", "value"),
    NUMERIC_OPTIONS,
    ids=[f"{c[0]}{o}={v}" for c, o, v in NUMERIC_OPTIONS],
)
def test_a_numeric_option_outside_its_range_exits_2_naming_the_option_before_any_work(
    capsys: pytest.CaptureFixture[str], no_work: None, command: list[str], option: str, value: str
):
    with pytest.raises(SystemExit) as info:
        kvsched.cli.main([*command, f"{option}={value}"])
    _, err = capsys.readouterr()
    assert info.value.code == 2
    assert f"argument {option}:" in err and "Traceback" not in err
