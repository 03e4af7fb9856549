"""The ``mooncake`` fixture: a Mooncake master + memory holder inside a private network
namespace, and a scenario runner (``mooncake_agent.py``) in the same namespace.

Mooncake's clients open listeners on 0.0.0.0 that no flag confines, so nothing of it runs in
the host's network namespace: the agent is started as
``unshare -rn sh -c 'ip link set lo up && exec python3 mooncake_agent.py'``. Tests skip, with
the exact reason, only where Mooncake cannot run: not Linux x86_64, package not installed,
``mooncake.store`` not importable (e.g. libibverbs1 missing), ``unshare``/``ip`` missing or
user+network namespaces not permitted, or the master cannot start.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

AGENT = Path(__file__).with_name("mooncake_agent.py")
START_TIMEOUT_S = 60.0
SCENARIO_TIMEOUT_S = 60.0


def _unavailable() -> str | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        here = f"{sys.platform} {platform.machine()}"
        return f"Mooncake wheels exist only for Linux x86_64 (this is {here})"
    if importlib.util.find_spec("mooncake") is None:
        return (
            "package mooncake-transfer-engine-non-cuda is not installed "
            "(pip install -e '.[mooncake]')"
        )
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return (
                f"`{tool}` is not installed (util-linux / iproute2): no private network namespace"
            )
    probe = subprocess.run(
        ["unshare", "-rn", "sh", "-c", "ip link set lo up"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"`unshare -rn` is not permitted here: {probe.stderr.strip()}"
    return None


class MooncakeAgent:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [
                "unshare",
                "-rn",
                "sh",
                "-c",
                'ip link set lo up && exec "$0" "$1"',
                sys.executable,
                str(AGENT),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=AGENT.parents[2],
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the Mooncake agent said nothing for {timeout_s}s") from None
        if line is None:
            raise RuntimeError(f"the Mooncake agent exited (rc={self.proc.wait()})")
        result: dict[str, Any] = json.loads(line)
        return result

    def run(self, scenario: str) -> dict[str, Any]:
        """Run one scenario in the namespace; fail the test with its traceback."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"scenario": scenario}) + "\n")
        self.proc.stdin.flush()
        reply = self.read(SCENARIO_TIMEOUT_S)
        if not reply.get("ok"):
            pytest.fail(f"scenario {scenario} failed inside the namespace:\n{reply.get('error')}")
        info: dict[str, Any] = reply.get("info", {})
        return info

    def stop(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"scenario": "__exit__"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:  # its master and holder die with it (PDEATHSIG)
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def mooncake() -> Iterator[MooncakeAgent]:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    agent = MooncakeAgent()
    try:
        first = agent.read(START_TIMEOUT_S)
        if "skip" in first:
            pytest.skip(str(first["skip"]))
        yield agent
    finally:
        agent.stop()
