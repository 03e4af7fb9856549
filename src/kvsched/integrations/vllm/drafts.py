"""Speculative decoding between vLLM and kvsched: which drafts a step verifies, the drafts the
model runner proposes, and the tokens a verified row produced.

vLLM's synchronous engine core proposes drafts after each step (``update_draft_token_ids``,
after ``update_from_output``); the adapter adds them to that step's ``StepExecuted``, which
kvsched folds at the next step (``DraftRows``). kvsched's policy chooses how many of them
each decode verifies (``DecodeScheduled.num_drafts``, at most ``num_speculative_tokens``);
the plan carries them after the row's newest token, and they become vLLM's
``scheduled_spec_decode_tokens``. The runner returns the accepted drafts and one more token
per row; vLLM's stop rule may end the request within them (the rest is dropped, as vLLM
does), and kvsched folds exactly the tokens vLLM kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from kvsched.events import types as ev
from kvsched.plan import StepPlan


def scheduled_drafts(plan: StepPlan, name_of: Any) -> dict[str, list[int]]:
    """vLLM's ``scheduled_spec_decode_tokens``: the drafts each plan row verifies, by name."""
    if not len(plan.num_drafts):
        return {}
    (rows,) = np.nonzero(plan.num_drafts)
    firsts = plan.token_bounds[rows] + 1  # (after the row's newest token)
    ids, names = plan.input_ids.tolist(), map(name_of, plan.seq_ids[rows].tolist())
    spans = zip(firsts.tolist(), (firsts + plan.num_drafts[rows]).tolist(), strict=True)
    return {name: ids[a:b] for name, (a, b) in zip(names, spans, strict=True)}


def most_tokens(plan: StepPlan) -> Iterable[int]:
    """The most tokens each sampled row of the plan may produce: its verified drafts and one
    more (one each without speculative decoding)."""
    if not len(plan.num_drafts):
        return itertools.repeat(1)
    most: list[int] = (1 + plan.num_drafts[plan.sample]).tolist()
    return most


def with_proposals(executed: ev.StepExecuted, proposals: dict[int, list[int]]) -> ev.StepExecuted:
    """``executed`` with the drafts proposed for each of its sequences (``proposals``: by
    sequence id; a sequence absent from it gets none)."""
    lists = [proposals.get(s, []) for s in executed.seq_ids.tolist()]
    counts = np.asarray([len(x) for x in lists], dtype=np.int32)
    flat = np.asarray([t for x in lists for t in x], dtype=np.int32)
    return msgspec.structs.replace(executed, draft_counts=counts, drafts=flat)
