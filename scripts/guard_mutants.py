"""Apply each hand-written mutant of a scheduler rule in a temporary copy of the tree, run the
tests meant to catch it there, and report: every mutant must be caught.

    python3 scripts/guard_mutants.py            # CAUGHT / SURVIVED per mutant; exit 1 if one
    python3 scripts/guard_mutants.py -k floor   # only the mutants whose text contains "floor"

The real sources are never edited: ``src/``, ``tests/`` and ``pyproject.toml`` are copied to a
temporary directory (the built kvs128 kernel included), each mutant is written into the copy,
its tests run there with ``PYTHONPATH=<copy>/src``, and the copy's file is put back. So an
interrupted run leaves nothing behind. A mutant whose original text is not found exactly once
is an error (exit 1): the rule moved, update this list.

The mutants: the guards a mutation probe found untested in issue 12, the eleven rules of
issue 24 and the three slips issue 24 found caught only far from their code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Mutant(NamedTuple):
    path: str  # under src/kvsched
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments: files or node ids (-k included if needed)


def m(path: str, old: str, new: str, *tests: str) -> Mutant:
    return Mutant(path, old, new, tests)


BUDGET = "budget.tokens + chunk.end - chunk.start <= self.config.max_prefill_tokens"
SPAN_END = "hi = min(last_block, (span.end - 1) // block_size + 1)"
RETRIES = "if seq.num_failures > self.config.max_step_retries:"
SCHED, IDENT = "tests/policy/test_scheduler.py", "tests/test_identity.py"
FLOOR = "self.floor = max(self.floor, e.priority)"
FIT = "return need <= pool.num_available - pool.count_unheld(hit)"
SETTLE_STOP = """            if verdict == "stop" and stop_on_failure:
                return False"""
SIZE = "cdiv(n, chunk) - start // chunk"
SAFE_LOOP = "step = min(starts) // block_size * block_size"
SPARES = "limit - 2)"
MISSING = "return _torn(file, offset, size, path, offset + PREFIX_SIZE)"
REL = "rel = sorted((b - first_block, x) for b, x in extras.items() if x)"
ADMISSION, ORDERING = "tests/policy/test_admission.py", "tests/policy/test_ordering.py"
MUTANTS = [
    # issue 12: guards a mutation probe once found untested
    m("policy/admission.py", BUDGET, BUDGET.replace("<=", "<"), SCHED, "-k", "budget"),
    m("policy/admission.py", BUDGET, BUDGET + " + 1", SCHED, "-k", "budget"),
    m("identity.py", SPAN_END, SPAN_END.replace(" + 1)", ")"), IDENT),
    m("identity.py", SPAN_END, "hi = min(last_block, span.end // block_size + 1)", IDENT),
    m(
        "policy/checkpoints.py",
        "return [(p, c) for p, c in victims if c.ckpt_id != keep]",
        "return list(victims)",
        "tests/policy/test_hybrid.py", "-k", "never_evicts",
    ),
    m(
        "policy/growth.py",
        "order = sorted(sessions, key=lambda k: (sessions[k].last_used, k))",
        "order = sorted(sessions, key=lambda k: (-sessions[k].last_used, k))",
        SCHED, "-k", "idle_session",
    ),
    m(
        "reducers/transfers.py",
        "load.num_blocks = min(e.num_blocks, load.num_blocks)",
        "load.num_blocks = e.num_blocks",
        "tests/replay/test_external.py", "-k", "beyond",
    ),
    m("policy/scheduler.py", RETRIES, RETRIES.replace(">", ">="), SCHED, "-k", "retries"),
    m("policy/scheduler.py", RETRIES, RETRIES.replace(":", " + 1:"), SCHED, "-k", "retries"),
    # issue 24, rules 1-11
    m(
        "policy/checkpoints.py",
        "if priority is not None and priority > worth:",
        "if priority is not None and priority >= worth:",
        "tests/policy/test_checkpoints.py", "-k", "worth_exactly",
    ),
    m("reducers/checkpoints.py", FLOOR, "self.floor = e.priority",
      "tests/reducers/test_checkpoints.py", "-k", "floor"),
    m(
        "policy/ordering.py",
        """        if self.config.order == "priority":
            return self._by_priority(seqs, state.clock)
        return sorted(seqs, key=_seq_arrival)""",
        "        return sorted(seqs, key=_seq_arrival)",
        ORDERING, "-k", "ready_loads",
    ),
    m("policy/admission.py", FIT, "return need <= pool.num_available", ADMISSION),
    m(
        "policy/admission.py",
        'return "skip"  # every row runs (only loads start now)',
        'return "stop"  # every row runs (only loads start now)',
        ADMISSION,
    ),
    m("policy/admission.py", SETTLE_STOP, SETTLE_STOP.replace("False", "True"), ADMISSION),
    m("policy/ordering.py", SIZE, "cdiv(n - start, chunk)", ORDERING, "-k", "canonical"),
    m(
        "policy/turns.py",
        "left = table.ntokens[chunk_rows] - table.computed[chunk_rows]",
        "left = table.ntokens[chunk_rows]",
        "tests/policy/test_turns.py", "-k", "last_chunk",
    ),
    m("policy/spans.py", SAFE_LOOP, "return min(starts) // block_size",
      "tests/policy/test_spans.py"),
    m("policy/growth.py", SPARES, "limit - 1)", "tests/policy/test_growth.py"),
    m("events/framing.py", MISSING, MISSING.replace("offset + PREFIX_SIZE", "size + PREFIX_SIZE"),
      "tests/events/test_framing_rules.py"),
    # issue 24: slips once caught only far from their code
    m(
        "policy/checkpoints.py",
        'elif config.places("session_end") and seq.session_id >= 0:',
        'elif config.places("session_end") and seq.session_id > 0:',
        "tests/policy/test_checkpoints.py", "-k", "session_0",
    ),
    m("policy/spans.py", "not span.start < step < span.end", "not span.start <= step < span.end",
      "tests/policy/test_spans.py"),
    m("identity.py", REL, REL.replace("(b - first_block, x)", "(b, x)"), IDENT, "-k", "continued"),
]  # fmt: skip


def copy_tree(dest: Path) -> None:
    """What the tests need, without caches: the mutants are applied to this copy only."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def check_found(mutants: list[Mutant]) -> list[str]:
    """Each mutant's text, found exactly once in the real source (else an error line)."""
    errors = []
    for mu in mutants:
        count = (ROOT / "src" / "kvsched" / mu.path).read_text().count(mu.old)
        if count != 1:
            errors.append(f"ERROR    {mu.path}: {mu.old!r} found {count} times: update this list")
    return errors


def run_one(tree: Path, mu: Mutant, env: dict[str, str]) -> tuple[bool, str]:
    """(caught, the first failure's summary line) with the mutant applied in ``tree``."""
    path = tree / "src" / "kvsched" / mu.path
    source = path.read_text()
    path.write_text(source.replace(mu.old, mu.new))
    try:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf"]
        result = subprocess.run(
            [*cmd, "--tb=short", *mu.tests], cwd=tree, env=env, capture_output=True, text=True
        )
    finally:
        path.write_text(source)
    lines = result.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAILED")]
    errors = [line for line in lines if line.startswith("E ")]
    why = " | ".join([*failed[:1], *errors[:1]]) or result.stdout.strip()[-300:]
    # 1: tests ran and failed (5 would be: none selected; others: an error, not a catch)
    return result.returncode == 1, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose new text contains this")
    args = parser.parse_args(argv)
    mutants = [mu for mu in MUTANTS if args.k in mu.new or args.k in mu.path]
    errors = check_found(mutants)
    for line in errors:
        print(line)
    survived = 0
    with tempfile.TemporaryDirectory(prefix="kvsched-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
        where = subprocess.run(
            [sys.executable, "-c", "import kvsched; print(kvsched.__file__)"],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not Path(where).is_relative_to(tree):
            raise SystemExit(f"the copy's tests would import kvsched from {where}, not the copy")
        for mu in mutants:
            if check_found([mu]):
                continue
            caught, why = run_one(tree, mu, env)
            survived += not caught
            first = mu.new.strip().splitlines()[0]
            print(f"{'CAUGHT  ' if caught else 'SURVIVED'} {mu.path}: {first}\n         {why}")
            sys.stdout.flush()
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
