"""The command-line scripts beside ``kvsched`` (scripts/): long steps say what they do."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).parents[1] / "scripts"


def test_vllm_env_prints_a_progress_line_per_step_on_stderr_and_only_the_python_on_stdout(
    tmp_path: Path,
):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"  # an existing environment whose python does nothing
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    done = subprocess.run(
        ["bash", str(SCRIPTS / "vllm_env.sh"), str(venv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{fake}\n"
    lines = done.stderr.splitlines()
    assert lines[0].startswith("vllm_env: building") and "2 minutes" in lines[0]
    assert [line.split()[1] for line in lines[1:5]] == ["1/4", "2/4", "3/4", "4/4"]
    assert lines[-1] == f"vllm_env: done: {fake}"
