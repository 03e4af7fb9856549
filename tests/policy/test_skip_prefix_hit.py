"""``RequestArrived.skip_prefix_hit`` (vLLM's ``skip_reading_prefix_cache``, set for prompt
logprobs): the request reads no cached prefix, local or external; its blocks are still
cached for the requests after it."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.events import types as ev
from kvsched.events.codec import decode_events, encode

from .helpers import Harness, config, matched, of_type, preset, tokens

PROMPT = tokens(80, seed=3)


def arrival(seq_id: int, **kw: object) -> ev.RequestArrived:
    return ev.RequestArrived(seq_id, np.concatenate([PROMPT, tokens(5, seed=seq_id)]), 2, **kw)


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_a_request_that_skips_the_prefix_cache_computes_its_whole_prompt(hybrid: bool):
    h = Harness(config(hybrid=True, **preset("kvsched")) if hybrid else None)
    h.step([arrival(0)])
    h.run_until_idle()
    result = h.step([arrival(1, skip_prefix_hit=True)])
    match = matched(result).get(1)
    assert match is None or match.num_tokens == 0
    h.run_until_idle()
    result = h.step([arrival(2)])  # an ordinary request still hits what both cached
    assert matched(result)[2].num_tokens >= 64


def test_a_request_that_skips_the_prefix_cache_asks_the_store_nothing():
    h = Harness(external_kv=True, role="decode")
    result = h.step([arrival(0, skip_prefix_hit=True)])
    assert not of_type(result.decisions, ev.KVLookupStarted)
    result = h.step([arrival(1)])
    assert of_type(result.decisions, ev.KVLookupStarted)


def test_skip_prefix_hit_is_omitted_from_the_log_at_its_default_and_round_trips():
    plain, skipping = arrival(0), arrival(1, skip_prefix_hit=True)
    assert b"skip_prefix_hit" not in encode(plain)
    assert decode_events(encode([skipping]))[0].skip_prefix_hit is True
