"""SessionTable through its folds: open sessions, their held blocks, and their history (the
finished turns the next turn continues)."""

from __future__ import annotations

import numpy as np
from tests.policy.helpers import Harness, request

from kvsched.events import types as ev


def _one_finished_turn(h: Harness, session_id: int = 3) -> None:
    h.step([request(0, 40, max_tokens=5, session_id=session_id)])
    h.run_until_idle()


def test_a_finished_turn_becomes_its_sessions_history_with_its_outputs() -> None:
    h = Harness()
    _one_finished_turn(h)
    history = h.state.sessions.history[3]
    assert len(history.tokens) == 45 == h.state.sessions.history_len(3)
    assert len(history.hashes) == 45 // 16


def test_the_next_turn_continues_from_the_history() -> None:
    h = Harness()
    _one_finished_turn(h)
    before = h.state.sessions.history[3].tokens.copy()
    h.step([request(1, 10, max_tokens=2, session_id=3)])
    seq = h.state.seqs.seqs[1]
    assert np.array_equal(seq.token_view()[: len(before)], before)


def test_closing_a_session_drops_its_history() -> None:
    h = Harness()
    _one_finished_turn(h)
    h.step([ev.SessionEnded(3)])
    assert 3 not in h.state.sessions.history and h.state.sessions.history_len(3) == 0


def test_the_history_kept_is_read_from_the_row_without_flushing_it() -> None:
    """The turn's last tokens may still sit in its row's tail: the history has them all, and
    keeping it changes nothing in the sequence table."""
    h = Harness()
    h.step([request(0, 40, max_tokens=30, session_id=3)])
    for _ in range(6):
        h.step()
    seqs = h.state.seqs
    seq = seqs.seqs[0]
    n = seqs.num_tokens(seq)
    assert n > seq.n_tokens  # sampled tokens not flushed yet
    expected = seqs.tokens_upto(seq, n).copy()
    h.state.sessions._keep_history(0)
    assert seq.n_tokens < n and np.array_equal(h.state.sessions.history[3].tokens, expected)
