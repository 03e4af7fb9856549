"""replay/workload.py: the built-in chat workload and its speed-up."""

from __future__ import annotations

import numpy as np

from kvsched.replay.workload import chat_workload, speed_up


def test_the_first_turn_of_every_session_starts_with_the_shared_system_prompt():
    w = chat_workload(sessions=3, turns=2, system_tokens=32, seed=1)
    firsts = [t.request.prompt for t in w.turns if t.follows < 0]
    assert len(firsts) == 3
    assert all(np.array_equal(p[:32], firsts[0][:32]) for p in firsts)


def test_a_later_turn_follows_the_previous_turn_of_its_session():
    w = chat_workload(sessions=2, turns=3, seed=1)
    by_id = {t.request.seq_id: t for t in w.turns}
    for t in w.turns:
        if t.follows >= 0:
            assert by_id[t.follows].request.session_id == t.request.session_id
            assert t.follows == t.request.seq_id - 1


def test_one_seed_gives_one_workload():
    a, b = chat_workload(sessions=2, seed=3), chat_workload(sessions=2, seed=3)
    assert [t.arrival_s for t in a.turns] == [t.arrival_s for t in b.turns]
    pairs = zip(a.turns, b.turns, strict=True)
    assert all(np.array_equal(x.request.prompt, y.request.prompt) for x, y in pairs)


def test_a_speed_up_divides_arrival_and_think_times_by_its_factor():
    w = chat_workload(sessions=2, turns=2, seed=1)
    fast = speed_up(w, 4.0)
    assert [t.arrival_s for t in fast.turns] == [t.arrival_s / 4.0 for t in w.turns]
    assert [t.think_s for t in fast.turns] == [t.think_s / 4.0 for t in w.turns]
