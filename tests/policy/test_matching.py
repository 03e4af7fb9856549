"""policy/matching.py: the longest usable cached prefix of a request, a pure query."""

from __future__ import annotations

from tests.policy.helpers import Harness, of_type, request, tokens

from kvsched.events import types as ev
from kvsched.policy.common import NO_MATCH
from kvsched.policy.matching import Matcher

PROMPT = tokens(70, seed=7)  # 4 whole 16-token blocks and 6 tokens


def served_then_running(**overrides: object) -> Harness:
    """Request 1 ran to its end (its prompt cached); request 2, the same prompt, is running."""
    h = Harness(**overrides)
    h.step([request(1, PROMPT, max_tokens=1)])
    h.run_until_idle()
    h.step([request(2, PROMPT, max_tokens=8)])
    return h


def test_a_repeated_prompt_matches_its_whole_cached_blocks_never_the_last_token():
    h = served_then_running()
    match = Matcher(h.config).find_prefix(h.state, h.state.seq(2))
    assert match.num_tokens == 64 and len(match.blocks) == 4
    matched = of_type(h.results[-1].decisions, ev.PrefixMatched)
    assert [m.num_tokens for m in matched] == [64]


def test_find_prefix_emits_nothing_and_leaves_the_state_as_it_was():
    h = served_then_running()
    before = h.state.snapshot()
    Matcher(h.config).find_prefix(h.state, h.state.seq(2))
    assert h.state.snapshot() == before


def test_without_prefix_caching_nothing_matches():
    h = served_then_running(enable_prefix_caching=False)
    assert Matcher(h.config).find_prefix(h.state, h.state.seq(2)) is NO_MATCH
