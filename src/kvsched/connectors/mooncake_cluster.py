"""Start and stop a loopback-only Mooncake Store: ``mooncake_master`` plus a standalone
``mooncake_client`` memory holder (the recipe of ``scripts/mooncake_up.sh``, in Python).

Used by the test fixture and usable by hand. The master binds its RPC and admin HTTP ports to
127.0.0.1; the holder's transfer-engine listeners cannot be confined (they open on 0.0.0.0 /
[::]), so run this inside a private network namespace (``unshare -rn``) wherever the host is
shared. Processes are stopped by PID: SIGTERM, a bounded wait, then SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import attrs

__all__ = ["MooncakeCluster", "MooncakeUnavailable", "free_port", "mooncake_binary"]


class MooncakeUnavailable(RuntimeError):
    """Mooncake cannot run here (package missing, shared library missing, platform)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def mooncake_binary(name: str) -> str:
    """Path of a binary shipped inside the ``mooncake`` package (not its console shim)."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeUnavailable(
            "package mooncake-transfer-engine-non-cuda is not installed "
            "(pip install 'kvsched[mooncake]')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise MooncakeUnavailable(f"{path} is missing from the mooncake package")
    return str(path)


def _http_get(url: str, timeout: float = 0.5) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body: bytes = resp.read()
            return body.decode(errors="replace")
    except OSError:
        return ""


def _port_listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@attrs.define
class MooncakeCluster:
    """A running master + memory holder. Use :meth:`start`; stop with :meth:`stop`."""

    rpc_port: int
    metrics_port: int
    holder_port: int
    run_dir: Path
    master: subprocess.Popen[bytes]
    holder: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @classmethod
    def start(
        cls,
        *,
        segment: str = "256MB",
        lease_ttl_ms: int = 200,
        client_ttl_s: int = 2,
        timeout_s: float = 10.0,
        die_with_parent: bool = True,
    ) -> MooncakeCluster:
        """Start the master, wait until ready, start the holder, wait until its segment is
        mounted. Raises :class:`MooncakeUnavailable` or ``RuntimeError`` (with the logs).

        ``die_with_parent``: the kernel SIGKILLs both if this process dies first (Linux
        ``PR_SET_PDEATHSIG``), so a crashed caller leaves nothing behind."""
        master_bin = mooncake_binary("mooncake_master")
        holder_bin = mooncake_binary("mooncake_client")
        run_dir = Path(tempfile.mkdtemp(prefix="kvsched-mooncake-"))
        env = mooncake_env()
        rpc, metrics, holder_port = free_port(), free_port(), free_port()
        with open(run_dir / "master.log", "wb") as log:
            master = subprocess.Popen(
                [
                    master_bin,
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={rpc}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={metrics}",
                    f"--default_kv_lease_ttl={lease_ttl_ms}",
                    f"--client_ttl={client_ttl_s}",
                    "--minloglevel=1",
                    "--enable_metric_reporting=false",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        cluster = cls(rpc, metrics, holder_port, run_dir, master)
        try:
            cluster._wait(
                "master ready",
                lambda: (
                    '"service_ready":true' in _http_get(cluster._url("/health"))
                    and _port_listening(rpc)
                ),
                timeout_s,
            )
            with open(run_dir / "holder.log", "wb") as log:
                cluster.holder = subprocess.Popen(
                    [
                        holder_bin,
                        "--host=127.0.0.1",
                        f"--port={holder_port}",
                        f"--global_segment_size={segment}",
                        "--local_buffer_size=0",
                        f"--master_server_address=127.0.0.1:{rpc}",
                        "--metadata_server=P2PHANDSHAKE",
                        "--protocol=tcp",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    preexec_fn=_die_with_parent if die_with_parent else None,
                )
            cluster._wait("holder segment mounted", cluster._capacity_mounted, timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.metrics_port}{path}"

    def _capacity_mounted(self) -> bool:
        for line in _http_get(self._url("/metrics")).splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return float(line.split()[1]) > 0
        return False

    def _wait(self, what: str, ready: object, timeout_s: float) -> None:
        assert callable(ready)
        deadline = time.monotonic() + timeout_s
        while True:
            for name, proc in (("mooncake_master", self.master), ("mooncake_client", self.holder)):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} before {what}:\n{self.logs()}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"timed out after {timeout_s}s waiting for {what}:\n{self.logs()}"
                )
            time.sleep(0.03)

    def logs(self) -> str:
        out = []
        for name in ("master.log", "holder.log"):
            path = self.run_dir / name
            if path.exists():
                out.append(f"--- {name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)

    def kill_holder(self) -> None:
        """SIGKILL the memory holder (fault injection): its objects become unreadable."""
        if self.holder is not None and self.holder.poll() is None:
            self.holder.send_signal(signal.SIGKILL)
            self.holder.wait()

    def kill_master(self) -> None:
        """SIGKILL the master (fault injection): every client call fails with RPC_FAIL."""
        if self.master.poll() is None:
            self.master.send_signal(signal.SIGKILL)
            self.master.wait()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM both (in parallel), wait up to ``grace_s``, then SIGKILL; reap; clean up."""
        procs = [p for p in (self.holder, self.master) if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> MooncakeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def mooncake_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for Mooncake processes and clients: quiet logs, few setup retries,
    loopback advertised address."""
    env = dict(os.environ if base is None else base)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    return env
