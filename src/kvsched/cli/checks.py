"""Checks every command makes before its first step: the files it writes, and the options
that another option given would make ignored."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvsched.config import ConfigError, PrefillTurns
from kvsched.replay.setup import (
    SWEEP_KEYS,
    SetupError,
)


def fail(message: str, code: int = 2) -> int:
    print(f"kvsched: error: {message}", file=sys.stderr)
    return code


# ------------------------------------------------------------ files a command writes


def same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


def check_output(
    option: str, path: str | None, overwrite: bool, inputs: Sequence[str] = ()
) -> None:
    """Refuse, before any work, to write ``path`` over one of the ``inputs`` (even with
    ``--overwrite``) or over an existing file without ``--overwrite``."""
    if not path:
        return
    for given in inputs:
        if same_file(path, given):
            raise SetupError(f"{option} {path} is the input {given}: write the output elsewhere")
    if os.path.isfile(path) and not overwrite:
        raise SetupError(f"{option} {path} exists: give --overwrite to replace it, or another path")


def check_report(report: str | None, overwrite: bool) -> None:
    """Before the first step: matplotlib imports, ``report`` is a directory this process can
    write (probed by creating it and a file in it, then removing them), and it holds no
    earlier files unless ``--overwrite``."""
    if not report:
        return
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise SetupError(
            f"--report needs matplotlib ({exc}): pip install 'kvsched[plots]', or drop --report"
        ) from None
    where = Path(report)
    if where.exists() and not where.is_dir():
        raise SetupError(f"--report {report}: exists and is not a directory")
    if where.is_dir() and any(where.iterdir()) and not overwrite:
        raise SetupError(
            f"--report {report}: the directory is not empty: give --overwrite to write over "
            "its files, or another directory"
        )
    made = [p for p in (where, *where.parents) if not p.exists()]  # the deepest first
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        raise SetupError(f"--report {report}: cannot write there: {exc.strerror or exc}") from None
    finally:
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()


# ---------------------------------------------------- options that would have no effect


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args: argparse.Namespace, *dests: str) -> list[str]:
    return [_option(d) for d in dests if getattr(args, d, None) is not None]


def _no_effect(option: str, needs: str) -> SetupError:
    return SetupError(f"{option} has no effect without {needs}: add {needs} or drop {option}")


def check_run_options(args: argparse.Namespace) -> None:
    """Refuse the options ``demo`` and ``replay`` would silently ignore."""
    if args.model is not None and args.executor != "torch":
        raise _no_effect("--model", "--executor torch")
    if args.wait_subscribers and not args.publish:
        raise _no_effect("--wait-subscribers", "--publish")


_CHECKPOINT_OPTIONS = (
    "policies",
    "checkpoint_budget",
    "checkpoint_memory",
    "checkpoint_policy",
    "checkpoint_placement",
    "checkpoint_eviction",
    "checkpoint_interval",
)


def sweep_keys(args: argparse.Namespace) -> list[str]:
    """The keys of the ``--sweep`` options given (one string, or a list of them)."""
    specs = [args.sweep] if isinstance(args.sweep, str) else list(args.sweep or ())
    return [str(s).partition("=")[0].strip() for s in specs]


def check_replay_options(args: argparse.Namespace) -> None:
    """Refuse the ``replay`` options that another option given overrides."""
    check_run_options(args)
    if args.cost is not None and args.executor == "torch":
        raise SetupError("--cost sets the simulated executor's costs: drop it or --executor torch")
    keys = sweep_keys(args)
    for key in keys:
        if key in SWEEP_KEYS and getattr(args, key.replace("-", "_"), None) is not None:
            raise SetupError(
                f"--{key} and --sweep {key}=...: the sweep sets it in every run; drop one"
            )
    memory = "checkpoint-memory" in keys or args.checkpoint_memory is not None
    budget = "checkpoint-budget" in keys or args.checkpoint_budget is not None
    if memory and budget and not {"checkpoint-memory", "checkpoint-budget"} <= set(keys):
        raise SetupError(
            "--checkpoint-budget and --checkpoint-memory: the memory sets the number of "
            "checkpoints, the budget would be ignored; give one"
        )
    if args.policies is not None:
        for option in _given(
            args, "checkpoint_policy", "checkpoint_placement", "checkpoint_eviction"
        ):
            raise SetupError(f"--policies sets each run's rules: {option} has no effect with it")


def check_config_options(args: argparse.Namespace, hybrid: bool, order: str, turns: str) -> None:
    """Refuse the options a config without them ignores: checkpoint options without a hybrid
    model, prefill-turn options without the TTFT order."""
    checkpoints = _given(args, *_CHECKPOINT_OPTIONS)
    checkpoints += [f"--sweep {k}" for k in sweep_keys(args) if k.startswith("checkpoint-")]
    if checkpoints and not hybrid:
        raise _no_effect(checkpoints[0], "--hybrid")
    given = {
        field: getattr(args, dest)
        for dest, field in (
            ("prefill_turns", "policy"),
            ("short_turns", "short_per_long"),
            ("long_order", "long_order"),
        )
        if getattr(args, dest, None) is not None
    }
    try:  # the config's own refusal, told which options were given (a default given counts)
        PrefillTurns(**{"policy": turns, **given}).refuse_ignored(order, given=set(given))
    except ConfigError as exc:
        raise SetupError(_as_options(str(exc))) from None


# The config's names of the settings the turn options set, as the options (longest first).
_OPTIONS = (
    ("turns.policy 'interleave'", "--prefill-turns interleave"),
    ("turns.short_per_long", "--short-turns"),
    ("turns.long_order", "--long-order"),
    ("turns.policy", "--prefill-turns"),
    ("order 'ttft'", "--order ttft"),
)


def _as_options(message: str) -> str:
    for name, option in _OPTIONS:
        message = message.replace(name, option)
    return message
