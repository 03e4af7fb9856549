"""``kvsched replay`` sweeps from the command line: generated shapes, checkpoint budgets beside
checkpoint memories in one sweep, points in parallel processes, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvsched.cli


def test_a_generated_shape_sweeps_budgets_and_memories_in_two_jobs_into_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    report = tmp_path / "r"
    args = ["replay", "gen:chat-branching", "--seed", "2", "--limit", "30", "--hybrid"]
    args += ["--policies", "lmdeploy", "--sweep", "checkpoint-budget=4,unbounded"]
    args += ["--sweep", "checkpoint-memory=1GiB", "--jobs", "2", "--report", str(report)]
    assert kvsched.cli.main([*args, "--json"]) == 0
    out, err = capsys.readouterr()
    runs = json.loads(out)["runs"]
    assert [(r["checkpoint_policy"], r["sweep_key"]) for r in runs[:3]] == [
        ("lmdeploy", "checkpoint-budget"),
        ("lmdeploy", "checkpoint-budget"),
        ("lmdeploy", "checkpoint-memory"),
    ]
    assert "kvsched: [6] oracle checkpoint-memory=1 GiB:" in err  # a progress line per point
    table = (report / "sweep.md").read_text()
    assert "| point | lmdeploy | oracle |" in table and "| budget unbounded |" in table
    assert (report / "sweep.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--jobs", "2"], "--jobs runs sweep points in parallel: give --sweep or --policies"),
        (["--sweep", "max-batch=2", "--sweep", "max-batch=3"], "--sweep: each key once"),
        (["--shape-param", "branch_p=7"], "--shape-param: branch_p must be in [0, 1]"),
        (["--shape-param", "turns=3"], "--shape-param: 'turns=3': not a parameter"),
    ],
)
def test_bad_sweep_or_shape_options_exit_2_naming_the_option(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
):
    assert kvsched.cli.main(["replay", "gen:chat-branching", "--limit", "5", *args]) == 2
    assert message in capsys.readouterr().err
