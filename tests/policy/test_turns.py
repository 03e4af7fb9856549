"""Alternate turn mode: when a step is a prefill turn instead of a decode turn (lmdeploy's
do_prefill_default triggers: a half-empty batch, prefill_interval decode turns, a pending last
chunk, enough waiting tokens), and the options that turn the triggers on and off."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvsched.config import SchedulerConfig
from kvsched.engine import StepResult
from kvsched.events import types as ev
from kvsched.policy.turns import PrefillTurns

from .helpers import Harness, admitted, of_type, prefills, request


def turn(result: StepResult) -> str:
    """ "P" a prefill turn, "D" a decode turn, "-" neither."""
    if prefills(result):
        return "P"
    return "D" if of_type(result.decisions, ev.DecodeScheduled) else "-"


def alternate(**overrides: object) -> Harness:
    """Alternate turns, 2 rows (one running sequence keeps the batch half full), 8 decode
    turns before a forced prefill turn, 64-token chunks."""
    base: dict[str, object] = {"turn_mode": "alternate", "max_batch": 2, "prefill_interval": 8}
    base.update(overrides)
    return Harness(**base)


def decoding(h: Harness) -> None:
    """Sequence 0 admitted and decoding (one decode turn behind it)."""
    h.step([request(0, 16, max_tokens=60)])
    assert turn(h.step()) == "D"


def test_a_long_prompt_is_admitted_at_once_and_its_last_chunk_runs_after_one_decode_turn() -> None:
    h = alternate()
    decoding(h)
    arrival = h.step([request(1, 100, max_tokens=4)])  # 100 waiting tokens fill a 64 budget
    assert prefills(arrival) == [(1, 0, 64)]
    turns = [turn(h.step()) for _ in range(3)]
    assert turns == ["D", "P", "D"]
    assert (1, 64, 100) in prefills(h.results[-2])  # the last chunk, after one decode turn


def test_a_pending_last_chunk_makes_a_prefill_turn_after_one_decode_turn() -> None:
    # The waiting-token trigger off: the first chunk waits for prefill_interval decode turns.
    h = alternate(prefill_on_waiting_tokens=False)
    decoding(h)
    h.step([request(1, 100, max_tokens=4)])
    turns = [turn(h.step()) for _ in range(10)]
    first = turns.index("P")
    assert first == 6  # 8 decode turns in all (two before the arrival)
    assert turns[first + 1 : first + 3] == ["D", "P"]
    assert (1, 64, 100) in prefills(h.results[-10 + first + 2])


def test_with_prefill_on_last_chunk_off_a_last_chunk_waits_for_prefill_interval() -> None:
    h = alternate(prefill_on_waiting_tokens=False, prefill_on_last_chunk=False)
    decoding(h)
    h.step([request(1, 100, max_tokens=4)])
    turns = [turn(h.step()) for _ in range(16)]
    first = turns.index("P")
    assert turns[first + 1 : first + 9] == ["D"] * 8 and turns[first + 9] == "P"


def test_waiting_tokens_that_fill_a_prefill_budget_make_a_prefill_turn() -> None:
    h = alternate(max_batch=4)
    h.step([request(0, 16, max_tokens=60), request(1, 16, max_tokens=60)])
    assert turn(h.step()) == "D"
    arrival = h.step([request(2, 40, max_tokens=4)])  # 40 of 64 tokens: not enough
    assert turn(arrival) == "D" and turn(h.step()) == "D"
    more = h.step([request(3, 30, max_tokens=4)])  # 70 waiting tokens
    assert turn(more) == "P" and admitted(more) == [2]  # (3 does not fit the budget too)


def test_with_prefill_on_waiting_tokens_off_a_full_budget_waits_for_prefill_interval() -> None:
    h = alternate(max_batch=4, prefill_on_waiting_tokens=False)
    h.step([request(0, 16, max_tokens=60), request(1, 16, max_tokens=60)])
    h.step()
    turns = [turn(h.step([request(2, 70, max_tokens=4)] if i == 0 else [])) for i in range(8)]
    assert turns == ["D"] * 7 + ["P"]


def test_the_triggers_and_preallocation_are_checked_options() -> None:
    with pytest.raises(ValueError, match="decode_prealloc_tokens"):
        SchedulerConfig(decode_prealloc_tokens=-1)
    for flag in ("prefill_on_last_chunk", "prefill_on_waiting_tokens", "report_cached_tokens"):
        with pytest.raises(ValueError, match=flag):
            SchedulerConfig.from_log_header({flag: 1}, schema_version=4)


def test_logs_before_schema_4_run_without_the_triggers_preallocation_or_cached_counts() -> None:
    legacy = SchedulerConfig.from_log_header({}, schema_version=3)
    assert not legacy.legacy.prefill_on_last_chunk and not legacy.legacy.prefill_on_waiting_tokens
    assert legacy.decode_prealloc_tokens == 0 and not legacy.legacy.report_cached_tokens
    now = SchedulerConfig.from_log_header({}, schema_version=4)
    assert now.legacy.prefill_on_last_chunk and now.legacy.prefill_on_waiting_tokens
    assert now.legacy.report_cached_tokens


def test_a_running_prefill_on_its_last_chunk_is_short_work_not_long() -> None:
    """A long prefill is one with more than a chunk (64 tokens) *left*: rows with 36 and with
    exactly 64 tokens left are short work; only one with 65 left is long."""
    config = Harness().config
    turns = PrefillTurns(config, None, None)  # type: ignore[arg-type]
    known, computed = np.asarray([100, 128, 129]), np.asarray([64, 64, 64])
    seqs = SimpleNamespace(
        tokens_left=lambda rows: known[rows] - computed[rows], known_of=lambda rows: known[rows]
    )
    state = SimpleNamespace(seqs=seqs)
    last_chunks = np.asarray([0, 1])
    assert turns._work(state, last_chunks, []) == (True, False), "a last chunk counted as long"  # type: ignore[arg-type]
    assert turns._work(state, np.asarray([2]), []) == (False, True)  # type: ignore[arg-type]
