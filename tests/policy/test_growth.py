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
