"""``kvsched diff`` and ``kvsched verify``: compare two event logs, re-run one."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

from kvsched.cli.checks import (
    fail,
)
from kvsched.events import framing
from kvsched.events.codec import RecordDecodeError, SchemaVersionError
from kvsched.events.log import CorruptLogError
from kvsched.replay.diff import diff_logs, format_diff
from kvsched.replay.verify import LogError, VerifyInterrupted, verify_log


def cmd_diff(args: argparse.Namespace) -> int:
    try:
        result = diff_logs(args.log_a, args.log_b)
    except (CorruptLogError, SchemaVersionError, RecordDecodeError) as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot read {exc.filename or 'log'}: {exc.strerror or exc}")
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(format_diff(result, args.log_a, args.log_b))
    return 0 if result.identical else 1


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0: verified (a torn tail or crash padding after the last complete step is
    reported); 1: a divergence; 2: a damaged log, or one this kvsched cannot replay
    (unreadable, another schema version, an invalid config); 130: interrupted."""
    total = None if args.quiet else count_records(args.log)
    try:
        with tqdm(desc="verify", unit="step", total=total, disable=args.quiet) as bar:
            result = verify_log(args.log, on_step=lambda n: bar.update(1))
    except VerifyInterrupted as exc:
        print(exc, file=sys.stderr)
        return 130
    except CorruptLogError as exc:
        return fail(f"{exc} (the {exc.steps or 0} steps before it verified)")
    except LogError as exc:
        return fail(str(exc), 2)
    except OSError as exc:
        return fail(f"cannot read {args.log}: {exc.strerror or exc}")
    if result.torn_tail is not None:
        t = result.torn_tail
        print(
            f"torn tail at byte {t.offset} ({t.reason}); "
            f"verified the {result.steps} complete steps before it"
        )
    if result.padding:
        print(
            f"warning: {result.steps} complete steps, then {result.padding} zero bytes "
            "(crash padding)"
        )
    if result.divergence is not None:
        print(result.divergence.describe())
        print("1 divergence")
        return 1
    print(f"{result.steps} steps verified, 0 divergences")
    return 0


def count_records(path: str) -> int | None:
    """The number of records in the event log at ``path`` (``framing.count_records``: from
    the frames' length prefixes alone; a progress total), or None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return framing.count_records(f, os.fstat(f.fileno()).st_size)
    except OSError:
        return None


def add_diff_verify(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    diff = sub.add_parser("diff", help="where two event logs' decisions first differ")
    diff.add_argument("log_a", metavar="LOG_A")
    diff.add_argument("log_b", metavar="LOG_B")
    diff.add_argument("--json", action="store_true", help="print the comparison as JSON")
    diff.set_defaults(func=cmd_diff)
    verify = sub.add_parser("verify", help="re-run an event log and compare every decision")
    verify.add_argument("log")
    verify.add_argument("--quiet", action="store_true")
    verify.set_defaults(func=cmd_verify)
