"""The ``kvsched`` command: demo, replay, diff, verify, watch, bench."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from kvsched.cli.bench import add_bench
from kvsched.cli.checks import fail
from kvsched.cli.logs import add_diff_verify
from kvsched.cli.output import ReportError
from kvsched.cli.run import add_demo, add_replay
from kvsched.cli.watch import add_watch
from kvsched.events.log import LogOpenError, LogWriteError
from kvsched.events.wire import WireError
from kvsched.replay.setup import SetupError
from kvsched.replay.traces import TraceError

__all__ = ["INTERRUPTED", "STDOUT_CLOSED", "build_parser", "main", "on_interrupt"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    add_demo(sub)
    add_replay(sub)
    add_diff_verify(sub)
    add_watch(sub)
    add_bench(sub)
    return p


INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT, as a shell reports it)
STDOUT_CLOSED = 141  # exit status when stdout's reader went away (128 + SIGPIPE)


@contextlib.contextmanager
def on_interrupt(describe: Callable[[], str]) -> Iterator[None]:
    """Within the block, Ctrl-C ends the command with the one line ``kvsched: describe()``
    (e.g. "interrupted after N steps; ...") and exit status 130, printed by :func:`main`."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if exc.args:  # already described (e.g. the driver's RunInterrupted)
            raise
        raise KeyboardInterrupt(describe()) from None


def _interrupted(exc: KeyboardInterrupt) -> int:
    message = str(exc.args[0]) if exc.args else "interrupted"
    print(f"kvsched: {message}", file=sys.stderr)
    return INTERRUPTED


def _stdout_closed() -> int:
    """stdout's reader is gone (``| head``): stop quietly. stdout goes to /dev/null so the
    interpreter's final flush does not fail again (the Python docs' recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return STDOUT_CLOSED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvsched`` command: its exit status. Ordinary failures are one line
    ``kvsched: error: ...`` and 2 (or the command's own status); Ctrl-C is one line and 130
    (see :func:`on_interrupt`); a closed stdout (``| head``) ends quietly with 141; any other
    ``OSError`` (a file that cannot be read or written) is ``kvsched: error: FILE: reason``."""
    try:
        args = build_parser().parse_args(argv)
        code: int = args.func(args)
        sys.stdout.flush()  # inside: a reader gone before the last flush is caught here too
    except (SetupError, TraceError, LogOpenError, LogWriteError, ReportError, WireError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except BrokenPipeError:
        return _stdout_closed()
    except OSError as exc:  # any other file a command could not read or write
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return fail(f"{where}{exc.strerror or exc}")
    return code
