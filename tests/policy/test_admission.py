"""Admission (``policy/admission.py``): the step budget a chunk counts in; with soft loads,
what fits, and who may pass whom."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy.admission import Admission
from kvsched.policy.common import Chunk, StepBudget

from .helpers import config, of_type
from .test_external_loads import Store, loads_admitted, request


class _Pool:
    """A pool whose hit blocks are held by a checkpoint until it is evicted."""

    def __init__(self) -> None:
        self.num_available = 3
        self.unheld = 0

    def count_unheld(self, hit: np.ndarray) -> int:
        return self.unheld


class _EvictsTheHitsHolder:
    """``evict_for`` evicts the checkpoint holding the hit: its two path blocks become
    available, and both are hit blocks the admission attaches (unheld now)."""

    def evict_for(self, state: object, need: int, emit: object, keep: int) -> bool:
        pool = state.pool  # type: ignore[attr-defined]
        pool.num_available, pool.unheld = 5, 2
        return True


class _NoSpares:
    def num_spares(self, state: object) -> int:
        return 0

    def return_spares(self, state: object, emit: object) -> None:
        pass


def test_an_admission_does_not_fit_when_evicting_turns_its_gained_blocks_into_unheld_hits():
    """Need 4 with 3 available: the eviction gains 2 blocks, but they are the load's own
    local hit (attached, not taken), so only 3 remain for its need: it does not fit."""
    cfg = config(hybrid=True, checkpoint_budget=4)
    admission = Admission(cfg, None, _NoSpares(), _EvictsTheHitsHolder(), None, None)  # type: ignore[arg-type]
    state = type("State", (), {"pool": _Pool(), "hybrid": True})()
    hit = np.asarray([5, 6], dtype=np.int32)
    assert not admission.make_fit(state, 4, hit, -1, lambda e: None), "admitted short of blocks"  # type: ignore[arg-type]
    state.pool.num_available = 6
    assert admission.make_fit(state, 4, hit, -1, lambda e: None)  # type: ignore[arg-type]


def test_with_every_row_running_a_load_starts_behind_a_waiting_request_that_needs_a_row():
    """fcfs: request 1 (a store miss) waits for the only row; request 2, behind it, loads
    from the store without a row in the same step."""
    h = Store(max_batch=1)
    h.run(request(0, 16, max_tokens=40))  # (one block: no lookup) runs in the only row
    h.run(request(1, 64), request(2, 64))
    decisions = h.answer({2: 3})
    assert loads_admitted(decisions) == [2], "the waiting request held the load back"
    assert 1 in h.state.seqs.waiting and not admitted_ids(decisions)


def test_under_fcfs_nothing_waiting_is_admitted_past_a_ready_load_that_does_not_fit():
    """Load 1 ends needing 2 blocks for its next chunk with 1 available: it waits, and so
    does request 3 (1 block, which would fit) behind it; both are served later."""
    h = Store(num_blocks=13)
    h.run(request(1, 96))
    assert loads_admitted(h.answer({1: 4})) == [1]
    h.run(request(2, 100, max_tokens=8))
    h.answer({})  # a miss: admitted, borrowing load 1's reserved blocks
    decisions = h.run(ev.KVLoadFinished(1), request(3, 16))
    assert h.state.pool.num_available == 1 and not of_type(decisions, ev.KVLoadSettled)
    assert admitted_ids(decisions) == [], "a request was admitted past a ready load"
    h.drive()
    assert h.state.stats.requests_finished == 3


def admitted_ids(decisions: list[ev.Event]) -> list[int]:
    return [d.seq_id for d in of_type(decisions, ev.SequenceAdmitted)]


def test_a_chunk_counts_its_tokens_a_prefill_and_a_chunk_that_does_not_end_a_prompt():
    budget = StepBudget()
    admission = Admission(SchedulerConfig(), None, None, None, None, None)  # type: ignore[arg-type]
    state = SimpleNamespace(hybrid=False)  # (an attention model: no state to save)
    for seq_id, chunk in ((1, Chunk(0, 64, False)), (2, Chunk(16, 40, True))):
        seq = SimpleNamespace(seq_id=seq_id, mm_spans=())
        admission.add_prefill(state, seq, chunk, budget, lambda e: None)  # type: ignore[arg-type]
    assert (budget.tokens, budget.prefills, budget.long_chunks) == (88, 2, 1)
    assert (budget.seq_ids, budget.starts, budget.ends) == ([1, 2], [0, 16], [64, 40])
