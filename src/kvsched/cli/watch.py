"""``kvsched watch``: follow a published event stream."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from kvsched.cli.checks import (
    check_output,
    fail,
)
from kvsched.cli.options import COUNT, DEFAULT, positive_float
from kvsched.events.wire import WireError
from kvsched.replay.setup import (
    SetupError,
)
from kvsched.stream.watch import StreamError, Watched, dump, summary_line, watch


def cmd_watch(args: argparse.Namespace) -> int:
    """Exit 0: the stream was followed from its first step to its end without a gap (the
    view is the engine's cache); 1: it was not (joined late, gaps, or it was stopped by
    Ctrl-C or --timeout idle seconds: the summary and --dump are written all the same);
    2: the stream cannot be read."""
    if args.json and args.every is not None:
        raise SetupError("--every has no effect with --json (only the final summary is printed)")
    check_output("--dump", args.dump, args.overwrite)
    show: Callable[[str], None] = (lambda line: None) if args.json else print
    every = 100 if args.every is None else args.every
    print(f"kvsched: watching {args.endpoint} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        watched = watch(args.endpoint, timeout_s=args.timeout, every=every, on_line=show)
    except (WireError, StreamError) as exc:
        return fail(str(exc))
    if args.dump:
        try:
            dump(watched, args.dump)
        except OSError as exc:
            return fail(f"cannot write {args.dump}: {exc.strerror or exc}")
    summary = watched.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        print("final " + summary_line(summary))
        print(_watch_verdict(watched))
    return 0 if watched.complete else 1


def _watch_verdict(watched: Watched) -> str:
    if watched.complete:
        return f"stream ended after {watched.records} steps: followed completely"
    why = []
    if watched.first_seq:
        why.append(f"joined at step message {watched.first_seq}")
    if watched.gaps:
        why.append(f"{len(watched.gaps)} gap(s): {watched.gaps[:3]}")
    if watched.header is None:
        why.append("no header received")
    if watched.stopped == "interrupted":
        why.append("interrupted (Ctrl-C)")
    elif watched.stopped is not None:
        why.append(watched.stopped)
    return f"incomplete view ({'; '.join(why) or 'the stream did not end'})"


def add_watch(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    w = sub.add_parser(
        "watch",
        help="follow a published event stream: live admissions, hits and cache use",
        description="Subscribe to a stream published with --publish, rebuild the cache from "
        "its events and print a summary line every --every steps, then a final one.",
    )
    w.add_argument("endpoint", metavar="ENDPOINT", help="e.g. tcp://127.0.0.1:5557")
    w.add_argument("--every", type=COUNT, metavar="N", help="steps between lines (default: 100)")
    w.add_argument(
        "--timeout",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="stop after S idle seconds (the publisher died), as Ctrl-C does: the final line "
        "and --dump, exit 1" + DEFAULT,
    )
    w.add_argument("--dump", metavar="FILE", help="write the rebuilt cache view as JSON")
    w.add_argument("--overwrite", action="store_true", help="replace an existing --dump FILE")
    w.add_argument("--json", action="store_true", help="print only the final summary as JSON")
    w.set_defaults(func=cmd_watch)
