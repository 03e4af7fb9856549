"""How ``demo`` and ``replay`` show a run: progress bars, the summary, the report."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvsched.cli.checks import (
    fail,
)
from kvsched.replay.metrics import ReplayResult
from kvsched.replay.report import format_table, write_report
from kvsched.replay.runs import Progress


def progress_bars(quiet: bool) -> Progress:
    """A tqdm bar per run (disabled with ``quiet``)."""

    @contextlib.contextmanager
    def bar(desc: str, total: int) -> Iterator[Callable[[int], None]]:
        with tqdm(total=total, desc=desc, unit="req", disable=quiet, leave=False) as shown:

            def update(done: int) -> None:
                if done != shown.n:
                    shown.update(done - shown.n)

            yield update

    return bar


class ReportError(Exception):
    """A report that cannot be written: exit 2 with this message."""


def write_report_or_fail(report: str, write: Callable[..., object], *args: Any) -> None:
    """``write(*args)``, a report writer: a failure to write it is ``ReportError``."""
    try:
        write(*args)
    except (OSError, RuntimeError) as exc:
        raise ReportError(f"cannot write the report to {report}: {exc}") from None


def run_report(
    report: str, where: str | Path, title: str, result: ReplayResult, metrics: dict[str, Any]
) -> None:
    ttft = result.recorder.latencies()[0]
    write_report_or_fail(report, write_report, where, metrics, result.series, ttft, title)


def finish(
    args: argparse.Namespace, title: str, result: ReplayResult, metrics: dict[str, Any]
) -> int:
    """Write the report, print the run's summary, then the report's error if it failed
    (exit 2): a failed report loses no result."""
    failed = None
    if args.report:
        try:
            run_report(args.report, args.report, title, result, metrics)
        except ReportError as exc:
            failed = str(exc)
    if args.json:
        print(json.dumps(metrics))
    else:
        print(format_table(title, metrics))
        if args.log:
            print(f"  {'event log':<26}{args.log}")
        if args.report and failed is None:
            print(f"  {'report':<26}{args.report}")
    return fail(failed) if failed else 0
