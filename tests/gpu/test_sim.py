"""gpu/sim.py: the simulated executor (tokens from a pure function, a cost model's clock)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.helpers import Harness, request

from kvsched.gpu.sim import CostModel, SimulatedExecutor, sample_tokens


def test_a_sampled_token_depends_on_the_sequence_and_position_only_whatever_the_batch():
    ids, pos = np.arange(1, 40, dtype=np.int64), np.arange(100, 139, dtype=np.int64)
    batch = sample_tokens(ids, pos, 1000, seed=0)  # the vectorised path
    one = [int(sample_tokens(ids[i : i + 1], pos[i : i + 1], 1000, 0)[0]) for i in range(39)]
    assert batch.tolist() == one
    assert batch.min() >= 1 and batch.max() < 1000


def test_the_cost_model_parses_given_parameters_over_the_defaults_and_refuses_bad_ones():
    cost = CostModel.parse("overhead_s=0.5, prefill_attn_s=0")
    assert cost.overhead_s == 0.5 and cost.decode_seq_s == CostModel().decode_seq_s
    for bad in ("nonsense=1", "overhead_s=x", "overhead_s=-1", "overhead_s"):
        with pytest.raises(ValueError):
            CostModel.parse(bad)


def test_a_step_costs_its_overhead_plus_its_prefill_tokens():
    plan = Harness().step([request(1, 40)]).plan
    cost = CostModel(overhead_s=1.0, prefill_token_s=0.5, kv_token_s=0, prefill_attn_s=0)
    assert cost.step_time(plan) == 1.0 + 40 * 0.5


def test_a_sleeping_executor_refuses_to_run_until_woken():
    plan = Harness().step([request(1, 40)]).plan
    executor = SimulatedExecutor(1000)
    executor.sleep(1)
    with pytest.raises(RuntimeError, match="sleeps"):
        executor.execute(plan)
    executor.wake()
    assert executor.execute(plan).seq_ids.tolist() == [1]
