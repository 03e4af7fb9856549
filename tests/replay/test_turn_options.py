"""``kvsched replay``'s prefill-turn options (--prefill-turns, --short-turns, --long-order):
they reach the replayed config, the run verifies, and bad values exit 2 naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvsched.cli
from kvsched.events.log import read_log

from .test_replay_cli import run_cli, small_trace


def test_the_prefill_turn_options_set_the_replayed_config_and_the_run_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = tmp_path / "run.kvlog"
    code, _, _ = run_cli(
        capsys, "replay", str(small_trace(tmp_path)), "--order", "ttft", "--prefill-turns",
        "interleave", "--short-turns", "2", "--long-order", "fifo", "--max-prefill-tokens",
        "512", "--log", str(log), "--quiet",
    )
    config = read_log(str(log)).header["config"]
    turns = config["turns"]
    assert code == 0 and turns["policy"] == "interleave"  # (--short-turns needs it)
    assert turns["short_per_long"] == 2 and turns["long_order"] == "fifo"
    assert config["legacy"]["ttft_size"] == "after_match"
    assert run_cli(capsys, "verify", str(log), "--quiet")[0] == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [("--prefill-turns", "long_last"), ("--short-turns", "0"), ("--long-order", "lifo")],
)
def test_a_bad_prefill_turn_option_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str
):
    with pytest.raises(SystemExit) as exc:
        kvsched.cli.main(["replay", str(small_trace(tmp_path)), "--order", "ttft", option, value])
    assert exc.value.code == 2 and f"argument {option}:" in capsys.readouterr().err
