"""The simulated executor's cost model: step time from prefill tokens, decode batch size, KV
read volume and prefill attention; parameters parse from ``--cost`` text."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.gpu.sim import CostModel, attention_pairs, sample_tokens


class FakePlan:
    """The StepPlan fields the cost model reads."""

    def __init__(self, starts: list[int], ends: list[int], decode: int) -> None:
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)
        lens = self.ends - self.starts
        self.num_decode_tokens = decode
        self.num_prefill_tokens = int(lens.sum()) - decode

    @property
    def kv_tokens_read(self) -> int:
        return int(self.ends.sum())


def test_step_time_adds_overhead_prefill_decode_kv_read_and_attention_terms():
    cost = CostModel(
        overhead_s=1.0,
        prefill_token_s=0.1,
        decode_seq_s=0.01,
        kv_token_s=0.001,
        prefill_attn_s=1e-4,
    )
    plan = FakePlan(starts=[99, 0], ends=[100, 10], decode=1)  # one decode, one 10-token prefill

    pairs = 10 * (0 + 11 / 2)  # causal pairs of a 10-token chunk from position 0
    assert attention_pairs(plan) == pairs  # type: ignore[arg-type]
    expected = 1.0 + 10 * 0.1 + 1 * 0.01 + 110 * 0.001 + pairs * 1e-4
    assert cost.step_time(plan) == pytest.approx(expected)  # type: ignore[arg-type]


def test_a_later_prefill_chunk_attends_to_everything_before_it():
    first = FakePlan(starts=[0], ends=[1000], decode=0)
    second = FakePlan(starts=[1000], ends=[2000], decode=0)

    assert attention_pairs(second) > 2.9 * attention_pairs(first)  # type: ignore[arg-type]


def test_cost_model_parses_overrides_and_rejects_unknown_or_negative_parameters():
    cost = CostModel.parse("prefill_attn_s=0, overhead_s=0.002")

    assert cost.prefill_attn_s == 0 and cost.overhead_s == 0.002
    assert cost.decode_seq_s == CostModel().decode_seq_s
    with pytest.raises(ValueError, match="bad cost-model item 'speed=3'"):
        CostModel.parse("speed=3")
    with pytest.raises(ValueError, match="must be >= 0"):
        CostModel.parse("overhead_s=-1")
    with pytest.raises(ValueError, match="is not a number"):
        CostModel.parse("overhead_s=fast")


@pytest.mark.parametrize("n", [1, 7, 31, 32, 300])
def test_sampled_tokens_are_the_same_function_for_small_and_large_batches(n: int):
    rng = np.random.default_rng(n)
    seq_ids = rng.integers(0, 1 << 40, n)
    pos = rng.integers(0, 1 << 20, n)

    small = np.asarray(
        [sample_tokens(seq_ids[i : i + 1], pos[i : i + 1], 32000, 3)[0] for i in range(n)]
    )
    batch = sample_tokens(seq_ids, pos, 32000, 3)

    assert np.array_equal(small, batch)
    assert batch.min() >= 1 and batch.max() < 32000
