"""The Turns owner through its folds: the prefill turn follows PrefillTurnChosen within the
policy's states, a gated turn refuses a long prefill, and the interleaving counts short turns."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.events import types as ev
from kvsched.reducers.errors import ReplayMismatch
from kvsched.reducers.state import EngineState
from kvsched.statemachines import IllegalTransition, TurnState


def _state(**kw: object) -> EngineState:
    fields: dict[str, object] = {
        "model": ModelSpec(vocab_size=100, max_context=512),
        "block_size": 16,
        "num_blocks": 64,
        "max_batch": 4,
        "max_prefill_tokens": 64,
        "order": "ttft",
    }
    return EngineState(SchedulerConfig.from_dict({**fields, **kw}))


def _run_prefill(state: EngineState, seq_id: int, n_tokens: int, end: int) -> None:
    """Admit a fresh ``n_tokens`` prompt and schedule its tokens [0, end)."""
    state.apply(ev.StepStarted(state.step + 1, 0.0))
    prompt = np.arange(1, n_tokens + 1, dtype=np.int32) % 97 + 1
    state.apply(ev.RequestArrived(seq_id, prompt, 4))
    row = state.seqs.peek_free_row()
    state.apply(ev.SequenceAdmitted(seq_id, row))
    need = -(-end // 16)
    assert need <= state.pool.num_free
    blocks = state.pool.free_top(need)
    counts = np.asarray([len(blocks)], np.int32)
    state.apply(ev.BlocksAllocated(np.asarray([seq_id]), counts, blocks))
    state.apply(ev.PrefillScheduled(np.asarray([seq_id]), np.asarray([0]), np.asarray([end])))


def test_a_fixed_policy_starts_in_its_turn_and_refuses_turns_it_never_takes():
    assert _state(prefill_turns="long_first").turns.turn == TurnState.LONG_FIRST
    state = _state(prefill_turns="long_first")
    with pytest.raises(ReplayMismatch, match="short_only"):
        state.apply(ev.PrefillTurnChosen("short_only"))  # a machine edge, not this policy's
    with pytest.raises(ValueError, match="only by order 'ttft'"):  # (ignored: refused)
        _state(prefill_turns="short_only", order="fcfs")
    fcfs = _state(order="fcfs")  # other orders: standard turns
    assert fcfs.turns.turn == TurnState.STANDARD


def test_a_fallback_is_only_legal_from_a_gated_turn():
    state = _state(prefill_turns="short_only")
    state.apply(ev.PrefillTurnChosen("long_first", fallback=True))
    assert state.turns.turn == TurnState.LONG_FIRST
    with pytest.raises(IllegalTransition):
        state.apply(ev.PrefillTurnChosen("long_first", fallback=True))


def test_a_gated_turn_refuses_a_long_prefill_and_accepts_a_short_one():
    state = _state(prefill_turns="short_only")
    _run_prefill(state, 1, 40, 40)
    with pytest.raises(ReplayMismatch, match="short_only turn scheduled a long prefill"):
        _run_prefill(state, 2, 200, 64)  # 200 tokens left: more than a 64-token chunk


def test_interleaving_counts_short_turns_and_a_long_chunk_resets_the_count():
    state = _state()  # interleave, 3 short turns per long chunk
    state.apply(ev.PrefillTurnChosen("short_only"))
    _run_prefill(state, 1, 40, 40)
    _run_prefill(state, 2, 30, 30)
    assert state.turns.short_turns == 2 and not state.turns.long_turn_due
    _run_prefill(state, 3, 20, 20)
    assert state.turns.long_turn_due and state.turns.check_invariants() is None
    state.apply(ev.PrefillTurnChosen("long_first"))
    _run_prefill(state, 4, 100, 64)
    assert state.turns.short_turns == 0
    state.turns.short_turns = 4  # past the quota: only a broken policy gets there
    assert "short turns" in str(state.turns.check_invariants())
