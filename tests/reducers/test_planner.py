"""reducers/planner.py: ``plan_step``, the step plan built from the state alone."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.helpers import Harness, request

from kvsched.reducers.planner import plan_step


def test_a_new_request_is_planned_as_its_first_chunk_from_token_zero():
    h = Harness()
    plan = h.step([request(1, 40)]).plan
    assert plan.seq_ids.tolist() == [1]
    assert (plan.starts.tolist(), plan.ends.tolist()) == ([0], [40])


def test_the_plan_arrays_are_read_only():
    plan = Harness().step([request(1, 40)]).plan
    with pytest.raises(ValueError):
        plan.starts[0] = 1


def test_planning_twice_from_the_same_state_gives_the_same_plan():
    h = Harness()
    h.step([request(1, 40), request(2, 20)])
    a, b = plan_step(h.state), plan_step(h.state)
    assert np.array_equal(a.seq_ids, b.seq_ids) and np.array_equal(a.ends, b.ends)
