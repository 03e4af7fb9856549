"""Runs of a trace without the command line: one recorded run whose log verifies, and a sweep
that yields one run per value, each on the config with the swept key set."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.replay.test_replay_cli import small_trace

from kvsched.replay.runs import replay_trace, sweep_runs
from kvsched.replay.setup import SetupError, load_trace_replay, trace_config
from kvsched.replay.verify import verify_log


def test_one_replay_of_a_trace_returns_its_metrics_and_records_a_log_that_verifies(
    tmp_path: Path,
):
    setup = load_trace_replay(str(small_trace(tmp_path)))
    log = tmp_path / "run.kvlog"

    result = replay_trace(setup, trace_config(setup.trace), log=str(log), check=True)

    assert result.metrics["requests"] == 6 and result.metrics["finished"] == 6
    assert result.metrics["token_hit_rate"] > 0
    assert verify_log(log).ok


def test_a_sweep_yields_one_run_per_value_on_the_config_with_that_value(tmp_path: Path):
    setup = load_trace_replay(str(small_trace(tmp_path)), sweep="cache-blocks=24,96")
    assert setup.sweep is not None

    runs = list(sweep_runs(setup, trace_config(setup.trace), setup.sweep))

    assert [r.value for r in runs] == [24, 96]
    assert [r.metrics["cache_blocks"] for r in runs] == [24, 96]
    assert all(r.metrics["sweep_key"] == "cache-blocks" for r in runs)
    assert all(r.metrics["format"] == "mooncake" for r in runs)  # the trace's extra metrics
    assert runs[0].metrics["evictions"] > runs[1].metrics["evictions"] == 0


def test_a_sweep_stops_with_a_setup_error_at_the_first_value_the_scheduler_refuses(
    tmp_path: Path,
):
    setup = load_trace_replay(str(small_trace(tmp_path)))
    runs = sweep_runs(setup, trace_config(setup.trace), ("block-size", [32, 1 << 17]))

    assert next(runs).value == 32
    with pytest.raises(SetupError, match="--sweep block-size=131072: block_size must be an"):
        next(runs)


def test_budgets_and_memories_in_one_sweep_run_in_parallel_as_they_do_one_by_one(
    tmp_path: Path,
):
    setup = load_trace_replay(
        "gen:chat-branching",
        limit=40,
        policies="lmdeploy",
        sweep=["checkpoint-budget=2,unbounded", "checkpoint-memory=512MiB"],
    )
    config = trace_config(setup.trace, hybrid=True)

    one = list(sweep_runs(setup, config, setup.sweeps))
    two = list(sweep_runs(setup, config, setup.sweeps, jobs=2))

    points = [(r.policy, r.metrics["sweep_key"], r.value) for r in one]
    assert points == [(r.policy, r.metrics["sweep_key"], r.value) for r in two]
    assert points[:3] == [
        ("lmdeploy", "checkpoint-budget", 2),
        ("lmdeploy", "checkpoint-budget", 1 << 20),
        ("lmdeploy", "checkpoint-memory", 512 << 20),
    ]
    assert [r.policy for r in one[3:]] == ["oracle"] * 3  # the oracle joins every comparison
    same = [{k: v for k, v in r.metrics.items() if k != "wall_time_s"} for r in one]
    assert same == [{k: v for k, v in r.metrics.items() if k != "wall_time_s"} for r in two]
    assert one[-1].metrics["token_hit_rate"] > 0.3
    memory = one[2].metrics["state_memory_bytes"]
    assert 0 < memory <= 512 << 20 < one[1].metrics["state_memory_bytes"]
