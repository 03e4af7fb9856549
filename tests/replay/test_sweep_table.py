"""sweep.md and the sweep points' labels: one row per point (checkpoint budgets beside
checkpoint memories), one column per policy, the sequential ideal below."""

from __future__ import annotations

from typing import Any

from tests.replay.test_report import STATE_BYTES, a_run

from kvsched.replay.sweep_table import (
    UNBOUNDED_BUDGET,
    axis_label,
    point_label,
    sweep_markdown,
    sweep_points,
)

KEY = "checkpoint-budget+checkpoint-memory"


def mixed_runs() -> list[dict[str, Any]]:
    runs = []
    for policy, hit in (("kvsched", 0.5), ("oracle", 0.6)):
        runs.append(a_run(policy, 256, hit, 0.05, 1.0))
        runs.append(a_run(policy, UNBOUNDED_BUDGET, hit + 0.1, 0.01, 0.9))
        memory = a_run(policy, 16 << 30, hit - 0.1, 0.2, 1.2)
        runs.append({**memory, "sweep_key": "checkpoint-memory", "state_memory_bytes": 16 << 30})
    return runs


def test_points_of_several_keys_keep_the_runs_order_and_labels_read_as_units():
    points = sweep_points(KEY, [], mixed_runs())
    assert points == [
        ("checkpoint-budget", 256),
        ("checkpoint-budget", UNBOUNDED_BUDGET),
        ("checkpoint-memory", 16 << 30),
    ]
    assert [point_label(k, v) for k, v in points] == ["256", "unbounded", "16 GiB"]
    assert axis_label(KEY) == "checkpoint budget (states) | checkpoint memory (GiB)"


def test_the_markdown_table_has_a_row_per_point_and_a_column_per_policy():
    text = sweep_markdown("chat", KEY, [], mixed_runs())
    lines = text.splitlines()
    assert lines[0] == "### chat"
    assert lines[2] == "| point | kvsched | oracle |"
    rows = [line for line in lines if line.startswith("| budget") or line.startswith("| memory")]
    assert rows == [
        f"| budget 256 ({256 * STATE_BYTES / (1 << 30):.3g} GiB) | 50.0 % · 50 / 1,000 ms "
        "| 60.0 % · 50 / 1,000 ms |",
        "| budget unbounded | 60.0 % · 10 / 900 ms | 70.0 % · 10 / 900 ms |",
        "| memory 16 GiB | 40.0 % · 200 / 1,200 ms | 50.0 % · 200 / 1,200 ms |",
    ]
    assert "Sequential ideal (infinite cache, one request at a time): 5.5 %." in text
