"""Crash recovery: an engine killed mid-run (its log torn mid-record) restarts from its log,
rebuilds exactly the state of its last complete step, and finishes the workload with the same
decisions and outputs as an uninterrupted run."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.policy.helpers import state_snapshot
from tests.replay.log_helpers import sampled

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine, StepResult, create_log
from kvsched.events.codec import decode_record
from kvsched.events.log import read_log
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.driver import run
from kvsched.replay.recovery import RecoveryError, recover
from kvsched.replay.workload import chat_workload


class Crash(Exception):
    pass


def _config(hybrid: bool) -> SchedulerConfig:
    return SchedulerConfig.from_dict(
        dict(
            num_blocks=160,
            max_batch=8,
            max_prefill_tokens=256,
            hybrid=hybrid,
            # (kvsched's rules place no "decode": no decode interval)
            **({"checkpoint_budget": 6} if hybrid else {}),
        )
    )


WORKLOAD = chat_workload(
    sessions=6, turns=2, system_tokens=128, user_tokens=(16, 200), output_tokens=(4, 40), seed=3
)


def _snapshot(engine: Engine) -> tuple[object, ...]:
    ckpts = tuple(
        (c.ckpt_id, c.state, c.slot, c.step, c.key, c.pins, c.stamp, c.path.tobytes())
        for c in engine.state.ckpts.ckpts.values()
    )
    return (*state_snapshot(engine.state), ckpts, tuple(engine.state.ckpts.free_slots))


def _outputs(engine: Engine) -> dict[int, bytes]:
    return {s.seq_id: s.token_view().tobytes() for s in engine.state.seqs.seqs.values()}


def _uninterrupted(path: str, hybrid: bool) -> list[bytes]:
    config = _config(hybrid)
    engine = Engine(config, log=create_log(path, config))
    run(engine, SimulatedExecutor(config.model.vocab_size), WORKLOAD)
    engine.log.close()  # type: ignore[union-attr]
    return read_log(path).records


def _crashed_run(path: str, hybrid: bool, kill_at: int) -> dict[int, tuple[object, ...]]:
    """Run until step ``kill_at`` is logged, then die; returns the state after every step."""
    config = _config(hybrid)
    engine = Engine(config, log=create_log(path, config))
    snapshots: dict[int, tuple[object, ...]] = {}

    def on_step(result: StepResult) -> None:
        snapshots[result.step] = _snapshot(engine)
        if result.step == kill_at:
            raise Crash

    with pytest.raises(Crash):
        run(engine, SimulatedExecutor(config.model.vocab_size), WORKLOAD, on_step=on_step)
    # The process dies: the engine flushed every record, and the OS closes the file and releases
    # the log's writer lock. The log file is left as the dead process left it.
    engine.log.close()  # type: ignore[union-attr]
    return snapshots


@settings(max_examples=max(6, settings.default.max_examples // 4), deadline=None)
@given(hybrid=st.booleans(), kill_at=st.integers(2, 150), cut=st.integers(1, 40))
def test_a_killed_engine_restarts_from_its_torn_log_and_finishes_like_an_uninterrupted_run(
    hybrid: bool, kill_at: int, cut: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        reference = _uninterrupted(os.path.join(tmp, "ref.kvlog"), hybrid)
        kill_at = min(kill_at, len(reference) - 1)
        path = os.path.join(tmp, "run.kvlog")
        snapshots = _crashed_run(path, hybrid, kill_at)
        with open(path, "r+b") as f:  # the crash tore the last record
            f.truncate(os.path.getsize(path) - cut)

        recovered = recover(path, check_invariants=True)
        assert recovered.torn_tail is not None
        assert recovered.steps == kill_at - 1
        assert _snapshot(recovered.engine) == snapshots[kill_at - 1]

        config = recovered.engine.config
        run(
            recovered.engine,
            SimulatedExecutor(config.model.vocab_size),
            WORKLOAD,
            resume=recovered.resume,
        )
        recovered.engine.log.close()  # type: ignore[union-attr]
        resumed = read_log(path)
        assert resumed.torn_tail is None
        assert resumed.records == reference  # every decision and outcome as uninterrupted


def test_a_recovered_run_produces_the_same_outputs_as_an_uninterrupted_one() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref = os.path.join(tmp, "ref.kvlog")
        _uninterrupted(ref, hybrid=False)
        path = os.path.join(tmp, "run.kvlog")
        _crashed_run(path, False, kill_at=40)
        recovered = recover(path)
        config = recovered.engine.config
        run(
            recovered.engine,
            SimulatedExecutor(config.model.vocab_size),
            WORKLOAD,
            resume=recovered.resume,
        )
        recovered.engine.log.close()  # type: ignore[union-attr]
        expected = sampled(ref)
        assert len(expected) == len(WORKLOAD.turns)
        assert sampled(path) == expected


def test_recovery_refuses_a_log_whose_decisions_do_not_replay() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.kvlog")
        _crashed_run(path, False, kill_at=30)
        contents = read_log(path)
        config = _config(False)
        bad = os.path.join(tmp, "bad.kvlog")
        log = create_log(bad, SchedulerConfig.from_dict({**config.to_dict(), "max_batch": 1}))
        for payload in contents.records:
            log.append(payload)
        log.close()
        assert any(len(decode_record(p).decisions) > 1 for p in contents.records)
        with pytest.raises(RecoveryError):
            recover(bad)


def test_an_executor_that_raises_costs_a_retry_and_leaks_nothing() -> None:
    config = _config(False)
    engine = Engine(config, check_invariants=True)
    sim = SimulatedExecutor(config.model.vocab_size)

    class Flaky:
        calls = 0

        def execute(self, plan):  # type: ignore[no-untyped-def]
            Flaky.calls += 1
            if Flaky.calls % 5 == 0:
                raise RuntimeError("device lost")
            return sim.execute(plan)

    summary = run(engine, Flaky(), WORKLOAD)
    assert summary.finished == len(WORKLOAD.turns)
    assert engine.state.pool.ref.sum() == sum(len(s.held) for s in engine.state.sessions.values())
    assert np.all(engine.state.seqs.row_seq == -1)


def test_a_sequence_whose_steps_keep_failing_is_aborted_with_the_reason() -> None:
    config = _config(True)
    engine = Engine(config, check_invariants=True)

    class Broken:
        def execute(self, plan):  # type: ignore[no-untyped-def]
            raise RuntimeError("device lost")

    summary = run(engine, Broken(), WORKLOAD, max_steps=400)
    assert summary.aborted == summary.requests - summary.rejected > 0
    assert engine.state.pool.ref.sum() == sum(len(h) for h in engine.state.ckpts.holders())
    assert all(c.pins == 0 for c in engine.state.ckpts.ckpts.values())
