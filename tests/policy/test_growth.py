"""Block growth (``policy/growth.py``): decode preallocation's bound."""

from __future__ import annotations

from kvsched.events import types as ev

from .helpers import Harness, of_type, request


def test_preallocation_stops_at_the_last_position_a_sequence_can_write() -> None:
    """Prompt 10 + max_tokens 23 = 33 = 2 x 16 + 1: the last token written to KV is position
    31 (the last sampled token is never written), so two blocks are all it ever holds, even
    with two blocks of preallocation asked for."""
    h = Harness(decode_prealloc_tokens=32)
    h.step([request(0, 10, max_tokens=23)])
    h.run_until_idle()
    taken = [
        n
        for r in h.results
        for d in of_type(r.decisions, ev.BlocksAllocated)
        for s, n in zip(d.seq_ids.tolist(), d.counts.tolist(), strict=True)
        if s == 0
    ]
    assert sum(taken) == 2, f"blocks taken {taken}: preallocated past position 31"


def test_ending_a_sequence_releases_what_it_holds_before_its_end() -> None:
    """``Growth.end`` is the one way the policy ends a sequence: its BlocksFreed comes
    before the end, which the end's fold requires."""
    h = Harness()
    h.step([request(0, 40, max_tokens=30)])
    h.step()
    decisions: list[ev.Event] = []

    def emit(e: ev.Event) -> None:
        h.state.apply(e)
        decisions.append(e)

    seq = h.state.seqs.seqs[0]
    h.engine.policy.growth.end(h.state, [seq], ev.SequencePreempted(0, "test"), emit)
    assert [type(d) for d in decisions] == [ev.BlocksFreed, ev.SequencePreempted]
    assert h.state.pool.ref.sum() == 0
