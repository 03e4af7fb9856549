"""plan.py: the frozen step plan and its per-field digest."""

from __future__ import annotations

import attrs
import numpy as np
from tests.policy.helpers import Harness, request

from kvsched.plan import PLAN_FIELDS, first_plan_difference, plan_digest, tail_is_empty


def two_plans():
    h = Harness()
    plan = h.step([request(1, 40), request(2, 20)]).plan
    other = attrs.evolve(plan, ends=np.asarray(plan.ends) + 0)  # the same values
    return plan, other


def test_equal_plans_have_equal_digests_and_no_first_difference():
    plan, same = two_plans()
    assert plan_digest(plan) == plan_digest(same)
    assert first_plan_difference(plan_digest(plan), plan_digest(same)) is None


def test_the_first_difference_names_the_first_field_whose_digest_differs():
    plan, _ = two_plans()
    moved = attrs.evolve(plan, ends=np.asarray(plan.ends) - 1)
    assert first_plan_difference(plan_digest(plan), plan_digest(moved)) == "ends"


def test_a_plan_counts_its_sequences_and_tokens_and_an_empty_one_says_so():
    plan, _ = two_plans()
    assert (plan.num_seqs, plan.num_tokens) == (2, 60) and not plan.is_empty
    assert Harness().step().plan.is_empty


def test_the_fields_past_a_short_logged_layout_are_empty_in_a_plain_step():
    plan, _ = two_plans()
    assert tail_is_empty(plan, len(PLAN_FIELDS))
    assert not tail_is_empty(plan, 0)
