"""The argparse value types and the option groups several commands share."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo:,}, {hi:,}], got {value:,}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


COUNT = int_in(1, 1 << 40)  # a count of something (requests, samples, steps)
DEFAULT = " (default: %(default)s)"
OVERWRITE = "replace an existing --log file and write into a non-empty --report DIR"


def add_publish(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--publish",
        metavar="ENDPOINT",
        help="publish the event stream over ZeroMQ, e.g. tcp://127.0.0.1:5557 (kvsched watch)",
    )
    p.add_argument(
        "--wait-subscribers",
        type=int_in(0, 1 << 10),
        default=0,
        metavar="N",
        help="with --publish: wait (up to 10 s) for N subscribers before the first step" + DEFAULT,
    )
