"""The checkpoint policy (``policy/checkpoints.py``): what a full table makes room for, and
which finished turns save their end state."""

from __future__ import annotations

from types import SimpleNamespace

from kvsched.events import types as ev
from kvsched.policy.checkpoints import Checkpoints

from .helpers import Harness, config, of_type, request, tokens


class _FullTable:
    """A checkpoint table with no free slot until its one victim is evicted."""

    def __init__(self) -> None:
        self.free = 0

    def peek_slot(self) -> int:
        return self.free

    def room(self) -> int:
        return 1


def test_a_new_checkpoint_replaces_a_victim_worth_exactly_as_much() -> None:
    """A redundant candidate (worth its floor, 2.0) against a redundant victim at the same
    floor: the tie evicts the victim and saves the new one; only a victim worth more
    declines it."""
    policy = Checkpoints(config(hybrid=True, checkpoint_eviction="value"), None)  # type: ignore[arg-type]
    victim = SimpleNamespace(ckpt_id=9)
    state = SimpleNamespace(ckpts=_FullTable())
    evicted: list[ev.Event] = []

    def emit(e: ev.Event) -> None:
        evicted.append(e)
        state.ckpts.free = 5

    policy.ranked_victims = lambda state, keep=-1: [(2.0, victim)]  # type: ignore[method-assign]
    assert policy._make_room(state, 1, 2.0, emit), "a tie declined the new checkpoint"  # type: ignore[arg-type]
    assert evicted == [ev.CheckpointEvicted(9, 2.0)]
    state.ckpts.free, evicted[:] = 0, []
    assert not policy._make_room(state, 1, 1.5, emit) and not evicted  # type: ignore[arg-type]


def test_the_end_state_of_session_0s_turn_is_saved() -> None:
    """Session ids start at 0: session 0 is a session like any other."""
    h = Harness(hybrid=True, checkpoint_budget=8, checkpoint_placement=("session_end",))
    h.step([request(0, tokens(30, seed=6), max_tokens=9, session_id=0)])
    h.run_until_idle()
    saved = [d for r in h.results for d in of_type(r.decisions, ev.CheckpointReserved)]
    assert [(d.num_tokens, d.kind) for d in saved] == [(38, "session_end")], "not saved"
