"""Executor sleep levels: the torch executor releases its cache (level 1) and its weights too
(level 2), refuses plans while asleep and restores both on wake, so a run that sleeps in the
middle gives the same tokens as one that does not; the fingerprint executor loses its cache
contents."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.gpu.plans import SeqSpec, make_plan

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.fingerprint import FingerprintExecutor
from kvsched.gpu.model import HybridModel
from kvsched.gpu.torch_executor import TorchExecutor
from kvsched.plan import StepPlan
from kvsched.replay.driver import run
from kvsched.replay.workload import chat_workload

CONFIG = SchedulerConfig.from_dict(
    dict(
        model=ModelSpec(vocab_size=512),
        block_size=16,
        num_blocks=200,
        max_batch=4,
        max_prefill_tokens=64,
        hybrid=True,
        checkpoint_budget=16,
    )
)
# Everything arrives at once: the drain at 0.1 ms comes at the second step, mid-prefill.
WORKLOAD = chat_workload(
    sessions=3,
    turns=2,
    system_tokens=40,
    user_tokens=(5, 30),
    output_tokens=(4, 10),
    rate_per_s=1e6,
    think_s=0.0,
    vocab_size=512,
    seed=1,
)


class Watched:
    """The executor under test, with what its memory looked like at each sleep and wake."""

    def __init__(self, inner: TorchExecutor) -> None:
        self.inner = inner
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.seen: list[tuple[str, int, bool, str]] = []

    def execute(self, plan: StepPlan) -> ev.StepExecuted:
        out = self.inner.execute(plan)
        for seq_id, token in zip(out.seq_ids.tolist(), out.tokens.tolist(), strict=True):
            self.tokens[seq_id].append(token)
        return out

    def _look(self, what: str, level: int) -> None:
        weights = next(self.inner.model.parameters()).device.type
        self.seen.append((what, level, self.inner.cache.released, weights))

    def sleep(self, level: int) -> None:
        self.inner.sleep(level)
        self._look("sleep", level)

    def wake(self) -> None:
        self.inner.wake()
        self._look("wake", 0)


def serve(executor: TorchExecutor, level: int = 0) -> Watched:
    watched = Watched(executor)
    controls = [(1e-4, ev.DrainRequested(level=level)), (2e-4, ev.WakeRequested())]
    summary = run(
        Engine(CONFIG, check_invariants=True), watched, WORKLOAD, controls=controls if level else ()
    )
    assert summary.finished == len(WORKLOAD.turns)
    if level:
        assert summary.preemptions > 0  # the drain met sequences at work
    return watched


def executor_of(tiny_dir: Path, from_dir: bool) -> TorchExecutor:
    model = tiny_dir if from_dir else HybridModel.from_pretrained(tiny_dir)
    return TorchExecutor(model, CONFIG.num_blocks, CONFIG.block_size, CONFIG.num_state_slots, "cpu")


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("from_dir", [True, False], ids=["checkpoint-dir", "in-memory-model"])
def test_a_run_that_sleeps_and_wakes_gives_the_tokens_of_one_that_does_not(
    tiny_dir: Path, level: int, from_dir: bool
) -> None:
    plain = serve(executor_of(tiny_dir, from_dir))
    slept = serve(executor_of(tiny_dir, from_dir), level)
    weights_asleep = "meta" if level == 2 else "cpu"
    assert slept.seen == [("sleep", level, True, weights_asleep), ("wake", 0, False, "cpu")]
    assert slept.tokens == plain.tokens


def test_a_sleeping_torch_executor_refuses_plans_and_deepens_but_never_lightens(
    tiny_dir: Path,
) -> None:
    ex = executor_of(tiny_dir, True)
    plan = make_plan([SeqSpec(0, [5, 6, 7], 0, 3, [1], slot=1)], block_size=16)
    before = ex.execute(plan).tokens
    ex.sleep(2)
    ex.sleep(1)  # already deeper: stays at 2
    assert ex.sleep_level == 2
    with pytest.raises(RuntimeError, match="sleeps"):
        ex.execute(plan)
    with pytest.raises(ValueError, match="sleep level"):
        ex.sleep(3)
    ex.wake()
    assert np.array_equal(ex.execute(plan).tokens, before)
    assert torch.count_nonzero(ex.cache.key_all[:, 2:]) == 0  # a fresh, zeroed cache


def test_a_sleeping_fingerprint_executor_loses_its_cache_contents() -> None:
    ex = FingerprintExecutor(512, 8, 16, 4)
    plan = make_plan([SeqSpec(0, [5, 6, 7], 0, 3, [1], slot=1)], block_size=16)
    ex.execute(plan)
    assert ex.kv.any()
    ex.sleep(1)
    assert not ex.kv.any() and not ex.state.any()
    with pytest.raises(RuntimeError, match="sleeps"):
        ex.execute(plan)
    ex.wake()
    ex.execute(plan)
