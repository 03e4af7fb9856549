"""reducers/stats.py: the engine's counters, folded from the events a run records."""

from __future__ import annotations

from tests.policy.helpers import Harness, request, tokens

PROMPT = tokens(70, seed=7)


def test_a_repeated_prompt_counts_its_cached_blocks_as_hit_tokens_of_the_query():
    h = Harness()
    h.step([request(1, PROMPT, max_tokens=1)])
    h.run_until_idle()
    h.step([request(2, PROMPT, max_tokens=1)])
    h.run_until_idle()
    s = h.state.stats
    assert (s.requests_arrived, s.requests_finished) == (2, 2)
    assert (s.query_tokens, s.hit_tokens) == (140, 64)
    assert s.prefill_tokens == 70 + 6


def test_every_sampled_token_counts_once_as_generated():
    h = Harness()
    h.step([request(1, 20, max_tokens=3), request(2, 30, max_tokens=5)])
    h.run_until_idle()
    assert h.state.stats.generated_tokens == 3 + 5
    assert h.state.stats.steps == len(h.results)
