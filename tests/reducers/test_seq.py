"""reducers/seq.py: one sequence's record (tokens, prompt, cached-token counts)."""

from __future__ import annotations

import numpy as np

from kvsched.reducers.seq import Seq


def seq(n: int) -> Seq:
    tokens = np.arange(1, n + 1, dtype=np.int32)
    return Seq(seq_id=1, tokens=tokens, n_tokens=n, n_prompt=n, max_tokens=4, arrival_time=0.0)


def test_outputs_are_the_tokens_after_the_prompt():
    s = seq(5)
    s.tokens = np.append(s.tokens, [9, 9]).astype(np.int32)
    s.n_tokens = 7
    assert s.n_output == 2 and s.token_view().tolist() == [1, 2, 3, 4, 5, 9, 9]


def test_expert_ids_are_kept_only_while_they_are_contiguous_from_the_first_token():
    s = seq(8)
    s.record_experts(0, np.ones((3, 2), dtype=np.int16))
    s.record_experts(5, np.ones((2, 2), dtype=np.int16))  # a gap at 3..4: not kept
    assert s.n_experts == 3
    s.record_experts(3, np.full((2, 2), 7, dtype=np.int16))
    assert s.n_experts == 5 and s.experts is not None and s.experts[4].tolist() == [7, 7]
