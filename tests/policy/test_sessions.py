"""Sessions as an lmdeploy user expects them: an aborted (stopped) turn stays part of the
session, and memory pressure reclaims the least recently used idle session first."""

from __future__ import annotations

import numpy as np
from tests.policy.helpers import Harness, matched, of_type, request, tokens
from tests.policy.test_hybrid import hybrid

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev


def _abort_mid_decode(h: Harness, seq_id: int, session_id: int, steps: int = 12) -> np.ndarray:
    h.step([request(seq_id, tokens(40, seed=1), max_tokens=30, session_id=session_id)])
    for _ in range(steps):
        h.step()
    seq = h.state.seq(seq_id)
    h.state.seqs.flush(seq.row)
    before = seq.token_view().copy()  # the prompt and what it generated so far
    # The step in flight's outcome (one more token) is folded before the abort, in its step.
    result = h.step([ev.RequestAborted(seq_id)])
    assert of_type(result.decisions, ev.SequenceAborted)
    return (
        np.append(before, h.state.sessions.history[session_id].tokens[-1:])
        if (session_id in h.state.sessions.history)
        else before
    )


def test_an_aborted_turn_stays_in_its_session_and_the_next_turn_continues_from_it() -> None:
    h = Harness()
    before = _abort_mid_decode(h, 0, session_id=7)
    assert len(before) > 40  # it had generated tokens
    assert np.array_equal(h.state.sessions.history[7].tokens, before)
    held = len(h.state.sessions.get(7).held)
    assert held == len(before) // 16  # its full blocks stay held for the next turn
    result = h.step([request(1, tokens(5, seed=2), max_tokens=2, session_id=7)])
    turn = h.state.seq(1)
    assert np.array_equal(turn.token_view()[: len(before)], before)
    assert matched(result)[1].num_tokens == held * 16  # every held block is a hit
    h.run_until_idle()
    h.state.check_invariants()


def test_with_keep_aborted_turns_off_an_aborted_turn_leaves_the_session_as_it_was() -> None:
    h = Harness(keep_aborted_turns=False)
    _abort_mid_decode(h, 0, session_id=7)
    assert 7 not in h.state.sessions.history  # the first turn was aborted: no history at all
    h.step([request(1, tokens(5, seed=2), max_tokens=2, session_id=7)])
    assert h.state.seq(1).n_tokens == 5
    h.run_until_idle()


def test_ending_a_session_still_drops_its_aborted_turn_and_every_block() -> None:
    h = Harness()
    h.step([request(0, tokens(40, seed=3), max_tokens=30, session_id=4)])
    h.step()
    h.step()
    result = h.step([ev.SessionEnded(4)])
    assert not of_type(result.decisions, ev.SequenceAborted)[0].keep_history
    assert 4 not in h.state.sessions.history and h.state.pool.ref.sum() == 0


def test_a_hybrid_sessions_aborted_turn_saves_its_state_and_the_next_turn_restores_it() -> None:
    h = hybrid()
    _abort_mid_decode(h, 0, session_id=2)
    kept = len(h.state.sessions.history[2].tokens)
    h.run_until_idle()  # the save before the next forward is published
    result = h.step([request(1, tokens(5, seed=4), max_tokens=2, session_id=2)])
    hit = matched(result)[1]
    assert hit.ckpt_id >= 0 and kept - 16 < hit.num_tokens < kept  # its computed state
    h.run_until_idle()
    h.state.check_invariants()


def test_old_logs_run_with_aborted_turns_dropped_and_sessions_reclaimed_by_id() -> None:
    legacy = SchedulerConfig.from_log_header({}, schema_version=3)
    assert not legacy.legacy.keep_aborted_turns and legacy.legacy.session_reclaim == "session_id"
    now = SchedulerConfig.from_log_header({}, schema_version=4)
    assert now.legacy.keep_aborted_turns and now.legacy.session_reclaim == "last_use"


def _two_idle_sessions(h: Harness) -> None:
    """Session 9 is used first, session 5 after it: 9 is the least recently used."""
    h.step([request(0, 32, max_tokens=1, session_id=9)])
    h.run_until_idle()
    h.step([request(1, 32, max_tokens=1, session_id=5)])
    h.run_until_idle()


def test_memory_pressure_reclaims_the_least_recently_used_idle_session_first() -> None:
    h = Harness(num_blocks=8)  # 7 usable blocks: 2 held by each session
    _two_idle_sessions(h)
    assert len(h.state.sessions.get(9).held) == len(h.state.sessions.get(5).held) == 2
    h.step([request(2, 64, max_tokens=1)])  # needs 5 blocks: one session must go
    assert len(h.state.sessions.get(9).held) == 0  # the older one
    assert len(h.state.sessions.get(5).held) == 2


def test_reclaim_by_session_id_is_the_lowest_id_first() -> None:
    h = Harness(num_blocks=8, session_reclaim="session_id")
    _two_idle_sessions(h)
    h.step([request(2, 64, max_tokens=1)])
    assert len(h.state.sessions.get(5).held) == 0 and len(h.state.sessions.get(9).held) == 2
