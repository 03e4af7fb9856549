"""The driver lets the executor sleep and wakes it as the engine decides: after a step that
ends ``Drained`` has run, ``sleep(level)``; before a step that ``Woken`` ends runs, ``wake()``;
no plan runs on a sleeping executor. Sleeps are timed controls of a run."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from tests.policy.helpers import config

from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.plan import StepPlan
from kvsched.replay.driver import run
from kvsched.replay.workload import chat_workload


class Spy:
    """A simulated executor that records what the driver asked of it, in order."""

    def __init__(self) -> None:
        self.inner = SimulatedExecutor(1000)
        self.calls: list[tuple[str, int]] = []
        self.tokens: dict[int, list[int]] = defaultdict(list)

    def execute(self, plan: StepPlan) -> ev.StepExecuted:
        out = self.inner.execute(plan)  # (raises while asleep)
        self.calls.append(("execute", plan.step))
        for seq_id, token in zip(out.seq_ids.tolist(), out.tokens.tolist(), strict=True):
            self.tokens[seq_id].append(token)
        return out

    def sleep(self, level: int) -> None:
        self.inner.sleep(level)
        self.calls.append(("sleep", level))

    def wake(self) -> None:
        self.inner.wake()
        self.calls.append(("wake", 0))


WORKLOAD = chat_workload(
    sessions=4, turns=2, system_tokens=40, user_tokens=(5, 30), output_tokens=(8, 20),
    rate_per_s=50.0, think_s=0.01, vocab_size=1000, seed=3,
)


@pytest.mark.parametrize("level", [1, 2])
def test_a_timed_sleep_puts_the_executor_to_sleep_and_wakes_it_and_every_request_is_served(
    level: int,
) -> None:
    plain = Spy()
    run(Engine(config(), check_invariants=True), plain, WORKLOAD)
    spy = Spy()
    controls = [(0.05, ev.DrainRequested(level=level)), (0.08, ev.WakeRequested())]
    summary = run(Engine(config(), check_invariants=True), spy, WORKLOAD, controls=controls)
    kinds = [kind for kind, _ in spy.calls]
    assert kinds.count("sleep") == 1 and kinds.count("wake") == 1
    asleep, woken = kinds.index("sleep"), kinds.index("wake")
    assert spy.calls[asleep] == ("sleep", level) and woken == asleep + 1  # no plan between
    assert summary.finished == len(WORKLOAD.turns) and summary.preemptions > 0
    assert spy.tokens == plain.tokens  # the preempted sequences recomputed the same tokens


def test_a_drain_and_a_wake_in_one_step_sleep_then_wake_before_the_plan_runs() -> None:
    spy = Spy()
    controls = [(0.05, ev.DrainRequested(level=2)), (0.05, ev.WakeRequested())]
    run(Engine(config(), check_invariants=True), spy, WORKLOAD, controls=controls)
    i = spy.calls.index(("sleep", 2))
    assert spy.calls[i + 1] == ("wake", 0) and spy.calls[i + 2][0] == "execute"


def test_a_sleeping_simulated_executor_refuses_a_plan() -> None:
    executor = SimulatedExecutor(1000)
    engine = Engine(config())
    plan = engine.step([ev.RequestArrived(0, np.arange(1, 20, dtype=np.int32), 2)], 0.0).plan
    executor.sleep(2)
    with pytest.raises(RuntimeError, match="sleeps"):
        executor.execute(plan)
    executor.wake()
    assert len(executor.execute(plan).tokens) == 1
