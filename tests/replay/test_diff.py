"""replay/diff.py: where two event logs' decisions first differ."""

from __future__ import annotations

from pathlib import Path

import kvsched.cli
from kvsched.replay.diff import diff_logs, format_diff


def demo_log(tmp_path: Path, name: str, *extra: str) -> str:
    path = str(tmp_path / name)
    argv = ["demo", "--sessions", "3", "--turns", "2", "--quiet", "--json", "--log", path]
    assert kvsched.cli.main([*argv, *extra]) == 0
    return path


def test_two_runs_of_one_workload_are_identical(tmp_path: Path, capsys):
    a, b = demo_log(tmp_path, "a.kvlog"), demo_log(tmp_path, "b.kvlog")
    result = diff_logs(a, b)
    assert result.identical and result.steps_compared > 0
    assert result.config_changes() == {}


def test_another_cache_size_is_a_config_change_and_a_first_difference(tmp_path: Path, capsys):
    a = demo_log(tmp_path, "a.kvlog")
    b = demo_log(tmp_path, "b.kvlog", "--cache-blocks", "40")
    result = diff_logs(a, b)
    assert not result.identical and result.first is not None
    assert "num_blocks" in result.config_changes()
    assert "first difference at step" in format_diff(result, a, b)
