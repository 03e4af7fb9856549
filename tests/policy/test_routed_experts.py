"""Routed-expert replay: cached blocks carry the expert ids recorded when they were computed;
a hit returns them; for a request that asks for them, a block without them ends the match."""

import numpy as np
from tests.policy.helpers import VOCAB, Harness, matched, request, tokens

from kvsched.config import ModelSpec
from kvsched.gpu.sim import SimulatedExecutor

K = 4  # expert ids recorded per token


def _harness(**overrides: object) -> Harness:
    model = ModelSpec(vocab_size=VOCAB, max_context=1024, routed_experts_per_token=K)
    h = Harness(model=model, **overrides)
    h.executor = SimulatedExecutor(VOCAB, routed_experts_per_token=K)
    return h


def _serve(h: Harness, seq_id: int, prompt: np.ndarray, **kw: object) -> None:
    h.step([request(seq_id, prompt, max_tokens=1, **kw)])
    h.run_until_idle()


def test_a_hit_returns_the_routed_experts_recorded_when_the_prefix_was_computed() -> None:
    h = _harness()
    prompt = tokens(64, seed=3)
    h.step([request(0, prompt, max_tokens=2, return_routed_experts=True)])
    h.step()
    producer = h.state.seq(0)
    recorded = producer.experts[:64].copy()
    h.run_until_idle()
    admit = h.step([request(1, np.append(prompt, 5), max_tokens=2, return_routed_experts=True)])
    assert matched(admit)[1].num_tokens == 64
    consumer = h.state.seq(1)
    assert consumer.n_experts >= 64
    assert np.array_equal(consumer.experts[:64], recorded)


def test_a_block_without_routed_experts_ends_the_match_of_a_request_that_asks_for_them() -> None:
    h = _harness()
    prompt = tokens(64, seed=3)
    _serve(h, 0, prompt[:32])  # blocks 0-1 computed with expert ids recorded
    h.executor = SimulatedExecutor(VOCAB)  # a run that records none
    _serve(h, 1, prompt)  # blocks 2-3 computed without expert ids
    asks = h.step([request(2, np.append(prompt, 5), max_tokens=1, return_routed_experts=True)])
    assert matched(asks)[2].num_tokens == 32
    h.run_until_idle()
    plain = h.step([request(3, np.append(prompt, 5), max_tokens=1)])
    assert matched(plain)[3].num_tokens == 64


def test_a_hybrid_match_for_routed_experts_stops_before_a_block_without_them() -> None:
    h = _harness(hybrid=True, checkpoint_budget=8, max_prefill_tokens=32)
    prompt = tokens(64, seed=3)
    _serve(h, 0, prompt[:32])  # checkpoint at 32, blocks with expert ids
    h.executor = SimulatedExecutor(VOCAB)
    _serve(h, 1, prompt)  # checkpoint at 64, blocks 2-3 without expert ids
    asks = h.step([request(2, np.append(prompt, 5), max_tokens=1, return_routed_experts=True)])
    assert matched(asks)[2].num_tokens == 32
    h.run_until_idle()
    plain = h.step([request(3, np.append(prompt, 5), max_tokens=1)])
    assert matched(plain)[3].num_tokens == 64
