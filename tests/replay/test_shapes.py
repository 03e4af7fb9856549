"""The generated chat workload (gen:chat-branching): seeded, open loop, and shaped as
documented (system prompts, multi-turn histories, branches, bursts)."""

from __future__ import annotations

import collections

import attrs
import numpy as np
import pytest

from kvsched.replay.shapes import (
    ChatBranching,
    ShapeError,
    chat_branching,
    parse_params,
    token_ideal,
)
from kvsched.replay.traces import read_trace

SMALL = ChatBranching(
    conversations=60, system_prompts=1, system_tokens_min=512, system_tokens_max=512
)


def _prompts(params: ChatBranching, seed: int = 0) -> list[np.ndarray]:
    return [t.request.prompt for t in chat_branching(params, seed).turns]


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _branches(prompts: list[np.ndarray], system: int) -> int:
    """Requests that share more than the system prompt with an earlier prompt and diverge
    before its end: a regenerated or edited turn."""
    count = 0
    for i, p in enumerate(prompts):
        if any(system < _lcp(p, q) < len(q) for q in prompts[:i]):
            count += 1
    return count


def test_the_same_seed_gives_the_same_workload_and_another_seed_a_different_one():
    a, b, c = (chat_branching(SMALL, s) for s in (3, 3, 4))
    assert [t.arrival_s for t in a.turns] == [t.arrival_s for t in b.turns]
    assert all(
        np.array_equal(x.request.prompt, y.request.prompt)
        and x.request.max_tokens == y.request.max_tokens
        for x, y in zip(a.turns, b.turns, strict=True)
    )
    assert [len(t.request.prompt) for t in a.turns] != [len(t.request.prompt) for t in c.turns]


def test_requests_are_open_loop_numbered_in_arrival_order_for_the_oracle():
    turns = chat_branching(SMALL, 1).turns
    assert [t.request.seq_id for t in turns] == list(range(len(turns)))
    assert all(t.follows < 0 and t.request.session_id < 0 for t in turns)
    assert [t.arrival_s for t in turns] == sorted(t.arrival_s for t in turns)


def test_branches_share_a_history_and_diverge_at_a_turn_boundary():
    assert _branches(_prompts(SMALL), 512) >= 3


def test_without_branching_no_request_diverges_inside_a_history():
    assert _branches(_prompts(attrs.evolve(SMALL, branch_p=0.0)), 512) == 0


def test_later_turns_carry_the_whole_earlier_prompt_as_their_prefix():
    prompts = _prompts(attrs.evolve(SMALL, branch_p=0.0))
    grown = sum(
        any(len(q) < len(p) and _lcp(p, q) == len(q) and len(q) > 512 for q in prompts[:i])
        for i, p in enumerate(prompts)
    )
    assert grown >= 10


def test_bursts_arrive_at_the_same_instant_and_system_prompts_are_skewed():
    turns = chat_branching(ChatBranching(conversations=400), 0).turns
    starts = collections.Counter(t.arrival_s for t in turns)
    assert max(starts.values()) >= 8
    systems = collections.Counter(bytes(t.request.prompt[:256].tobytes()) for t in turns)
    counts = sorted(systems.values(), reverse=True)
    assert len(counts) <= 8 and counts[0] > 2 * counts[-1]


def test_no_bursts_when_their_share_is_zero():
    turns = chat_branching(attrs.evolve(SMALL, burst_p=0.0), 0).turns
    assert max(collections.Counter(t.arrival_s for t in turns).values()) == 1


def test_token_ideal_counts_whole_shared_blocks_never_the_last_token():
    a = np.arange(1, 201, dtype=np.int32)
    b = np.concatenate([a[:130], np.full(70, 7, np.int32)])
    # b hits 2 whole blocks of 64 (128 tokens) of a; a itself nothing; c = a hits 3 blocks
    assert token_ideal([a, b, a.copy()], 64) == pytest.approx((128 + 192) / 600)


def test_a_bad_shape_parameter_is_an_error_naming_it():
    with pytest.raises(ShapeError, match="branch_p"):
        parse_params(ChatBranching, "branch_p=1.5")
    with pytest.raises(ShapeError, match="'nope=1': not a parameter"):
        parse_params(ChatBranching, "nope=1")
    with pytest.raises(ShapeError, match="conversations='x': not a int"):
        parse_params(ChatBranching, "conversations=x")


def test_gen_trace_reads_with_its_ideal_and_a_limit():
    trace = read_trace("gen:chat-branching", block_size=64, limit=50)
    assert trace.info.format == "gen" and trace.info.requests == 50
    assert 0 < (trace.info.ideal_hit_rate or 0) < 1
