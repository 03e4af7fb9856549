"""Replay metrics folded by the recorder."""

from __future__ import annotations

from pathlib import Path

from tests.replay.test_replay_cli import small_trace

from kvsched.replay.runs import sweep_runs
from kvsched.replay.setup import load_trace_replay, trace_config


def test_a_hybrid_run_with_a_small_checkpoint_budget_counts_its_checkpoint_evictions(
    tmp_path: Path,
):
    setup = load_trace_replay(str(small_trace(tmp_path)), sweep="checkpoint-budget=2,16")
    assert setup.sweep is not None

    runs = list(sweep_runs(setup, trace_config(setup.trace, hybrid=True), setup.sweep))

    small, large = (r.metrics for r in runs)
    assert small["checkpoint_evictions"] == runs[0].result.recorder.engine.state.ckpts.evictions
    assert small["checkpoint_evictions"] > large["checkpoint_evictions"] == 0
    assert small["kv_block_evictions"] == large["kv_block_evictions"] == 0
    assert small["evictions"] == small["kv_block_evictions"]  # the old name
