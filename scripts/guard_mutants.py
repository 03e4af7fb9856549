"""Apply each hand-written mutant of a scheduler guard, run the tests meant to catch it, and
restore the source: every mutant must be caught.

    python3 scripts/guard_mutants.py    # CAUGHT / SURVIVED per mutant; exit 1 if one survives

The six guards a mutation probe once found untested (issue 12), and the tests that now
guard them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = "budget.tokens + chunk.end - chunk.start <= self.config.max_prefill_tokens"
SPAN_END = "hi = min(last_block, (span.end - 1) // block_size + 1)"
RETRIES = "if seq.num_failures > self.config.max_step_retries:"
SCHED, IDENT = "tests/policy/test_scheduler.py", "tests/test_identity.py"
MUTANTS = [
    ("policy/admission.py", BUDGET, BUDGET.replace("<=", "<"), SCHED, "budget"),
    ("policy/admission.py", BUDGET, BUDGET + " + 1", SCHED, "budget"),
    ("identity.py", SPAN_END, SPAN_END.replace(" + 1)", ")"), IDENT, ""),
    ("identity.py", SPAN_END, "hi = min(last_block, span.end // block_size + 1)", IDENT, ""),
    (
        "policy/checkpoints.py",
        "order = [c for c in state.ckpts.eviction_order() if c.ckpt_id != keep]",
        "order = list(state.ckpts.eviction_order())",
        "tests/policy/test_hybrid.py",
        "never_evicts",
    ),
    (
        "policy/growth.py",
        "for session_id in sorted(state.sessions.sessions):",
        "for session_id in sorted(state.sessions.sessions, reverse=True):",
        SCHED,
        "idle_session",
    ),
    (
        "reducers/transfers.py",
        "load.num_blocks = min(e.num_blocks, load.num_blocks)",
        "load.num_blocks = e.num_blocks",
        "tests/replay/test_external.py",
        "beyond",
    ),
    ("policy/scheduler.py", RETRIES, RETRIES.replace(">", ">="), SCHED, "retries"),
    ("policy/scheduler.py", RETRIES, RETRIES.replace(":", " + 1:"), SCHED, "retries"),
]  # fmt: skip


def run_one(path: Path, old: str, new: str, tests: str, select: str) -> bool:
    source = path.read_text()
    if source.count(old) != 1:
        raise SystemExit(f"{path}: the guard {old!r} is not there once: update this script")
    path.write_text(source.replace(old, new))
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", tests]
        result = subprocess.run([*cmd, *(["-k", select] if select else [])], capture_output=True)
        return result.returncode == 1  # 1: tests ran and failed (5 would be: none selected)
    finally:
        path.write_text(source)


def main() -> int:
    survived = 0
    for rel, old, new, tests, select in MUTANTS:
        caught = run_one(ROOT / "src" / "kvsched" / rel, old, new, tests, select)
        survived += not caught
        print(f"{'CAUGHT  ' if caught else 'SURVIVED'} {rel}: {new}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
