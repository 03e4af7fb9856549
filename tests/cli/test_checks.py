"""cli/checks.py: what every command checks before its first step."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvsched.cli.checks import check_output, check_run_options
from kvsched.replay.setup import SetupError


def test_an_output_is_never_written_over_an_input_even_with_overwrite(tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("{}\n")
    with pytest.raises(SetupError, match="is the input"):
        check_output("--log", str(trace), True, inputs=[str(trace)])


def test_an_existing_output_needs_overwrite(tmp_path: Path):
    log = tmp_path / "run.kvlog"
    log.write_bytes(b"x")
    with pytest.raises(SetupError, match="--overwrite"):
        check_output("--log", str(log), False)
    check_output("--log", str(log), True)
    check_output("--log", str(tmp_path / "new.kvlog"), False)


def test_an_option_that_would_be_ignored_is_refused_naming_what_it_needs():
    args = argparse.Namespace(model="m", executor="sim", wait_subscribers=0, publish=None)
    with pytest.raises(SetupError, match="--model has no effect without --executor torch"):
        check_run_options(args)
    args = argparse.Namespace(model=None, executor="sim", wait_subscribers=2, publish=None)
    with pytest.raises(SetupError, match="--wait-subscribers has no effect without --publish"):
        check_run_options(args)
