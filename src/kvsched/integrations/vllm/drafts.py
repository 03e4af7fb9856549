"""Speculative decoding between vLLM and kvsched: which drafts a step verifies, the drafts the
model runner proposes, and the tokens a verified row produced.

vLLM's synchronous engine core proposes drafts after each step (``update_draft_token_ids``,
after ``update_from_output``); the adapter adds them to that step's ``StepExecuted``, which
kvsched folds at the next step (``Seq.drafts``). kvsched's policy chooses how many of them
each decode verifies (``DecodeScheduled.num_drafts``, at most ``num_speculative_tokens``);
the plan carries them after the row's newest token, and they become vLLM's
``scheduled_spec_decode_tokens``. The runner returns the accepted drafts and one more token
per row; vLLM's stop rule may end the request within them (the rest is dropped, as vLLM
does), and kvsched folds exactly the tokens vLLM kept.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvsched.events import types as ev
from kvsched.plan import StepPlan


def scheduled_drafts(plan: StepPlan, name_of: Any) -> dict[str, list[int]]:
    """vLLM's ``scheduled_spec_decode_tokens``: the drafts each plan row verifies, by name."""
    if not len(plan.num_drafts):
        return {}
    bounds = np.concatenate(([0], np.cumsum(plan.ends - plan.starts)))
    out: dict[str, list[int]] = {}
    for i in np.nonzero(plan.num_drafts)[0].tolist():
        first = int(bounds[i]) + 1  # (after the row's newest token)
        out[name_of(int(plan.seq_ids[i]))] = plan.input_ids[
            first : first + plan.num_drafts[i]
        ].tolist()
    return out


def verified_of(plan: StepPlan) -> dict[int, int]:
    """Sequence id -> drafts it verifies in this plan (only those that verify any)."""
    if not len(plan.num_drafts):
        return {}
    rows = np.nonzero(plan.num_drafts)[0]
    return dict(zip(plan.seq_ids[rows].tolist(), plan.num_drafts[rows].tolist(), strict=True))


def with_proposals(executed: ev.StepExecuted, proposals: dict[int, list[int]]) -> ev.StepExecuted:
    """``executed`` with the drafts proposed for each of its sequences (``proposals``: by
    sequence id; a sequence absent from it gets none)."""
    lists = [proposals.get(s, []) for s in executed.seq_ids.tolist()]
    counts = np.asarray([len(x) for x in lists], dtype=np.int32)
    flat = np.asarray([t for x in lists for t in x], dtype=np.int32)
    return msgspec.structs.replace(executed, draft_counts=counts, drafts=flat)
