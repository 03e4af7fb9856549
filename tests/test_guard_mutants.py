"""The mutant guard (``scripts/guard_mutants.py``) in the default suite: every listed slip is
caught, both rounds (about 6 minutes on the shared 2-core machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(2400)  # one test for ~70 mutants: the suite's 600 s per test is too short
def test_every_hand_written_mutant_of_a_guarded_rule_is_caught() -> None:
    script = ROOT / "scripts" / "guard_mutants.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SURVIVED" not in result.stdout and "CAUGHT" in result.stdout
