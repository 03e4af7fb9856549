"""vLLM's own data parallelism under kvsched: one OpenAI server with ``--data-parallel-size 2``
runs an engine core, and so a kvsched scheduler, per rank; vLLM's internal load balancer
spreads requests by the counts each scheduler reports (``get_request_counts``); each rank
writes its own log (rank 0 the path given, rank 1 ``run.dp1.kvlog``), which verifies, and
publishes its KV events on its own port, tagged with its rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment: scripts/test_vllm.sh builds .venv-vllm",
)

import msgspec

from kvsched.integrations.vllm import cluster as cl
from kvsched.integrations.vllm.listen import Listener
from kvsched.integrations.vllm.models import build

HOST = "127.0.0.1"
RANKS = 2
REQUESTS = 8


def _free_port(span: int = 1) -> int:
    """A port with ``span`` - 1 free ports above it (vLLM offsets rank r's events by r)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if all(_free(port + i) for i in range(1, span)):
            return port
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A DP=2 server under kvsched: every request's answer, the rank tags seen on each
    events port, and the log path given (each rank's log beside it)."""
    out = tmp_path_factory.mktemp("dp")
    model = build("qwen3", out / "model")
    port, events = _free_port(), _free_port(RANKS)
    log = out / "run.kvlog"
    cmd = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
        *("--scheduler-cls", "kvsched.integrations.vllm.Scheduler"),
        *("--host", HOST, "--port", str(port), "--block-size", "32", "--enforce-eager"),
        *("--data-parallel-size", str(RANKS), "--data-parallel-address", HOST),
        *("--max-model-len", "1024", "--max-num-seqs", "4", "--dtype", "float32"),
        *("--kv-events-config", cl.kv_events_config(events)),  # (bound: several-engines.md)
    ]
    env = {
        **os.environ,
        "KVSCHED_VLLM_LOG": str(log),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # (data parallelism needs its processes)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    listeners = [Listener(connect=f"tcp://{HOST}:{events + r}") for r in range(RANKS)]
    try:
        base = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 900
        while True:
            if cl.healthy(base):
                break
            assert proc.poll() is None, proc.stderr.read()[-4000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the DP server did not start in 15 min"
            time.sleep(1)
        for listener in listeners:
            listener.__enter__()
        time.sleep(1)  # (the subscriptions take effect)
        answers: dict[int, dict[str, Any]] = {}

        def ask(i: int) -> None:
            prompt = [5 + (7 * i + j) % 400 for j in range(96)]
            body = {
                "model": str(model),
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            }
            answers[i] = cl.post(base + "/v1/completions", body)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        time.sleep(1)
    finally:
        for listener in listeners:
            listener.__exit__(None, None, None)
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    seen = {  # the data_parallel_rank of every KV event batch, per events port
        events + r: {msgspec.msgpack.decode(payload)[-1] for _, payload in listener.messages}
        for r, listener in enumerate(listeners)
        if listener.messages
    }
    return {"answers": answers, "seen": seen, "log": log, "events": events}


def _kvsched(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsched.cli", *args], capture_output=True, text=True, timeout=600
    )


def test_vllm_data_parallel_ranks_each_run_kvsched_with_their_own_log_which_verifies(served):
    assert len(served["answers"]) == REQUESTS
    assert all(a["usage"]["completion_tokens"] == 24 for a in served["answers"].values())
    log: Path = served["log"]
    requests = []
    for rank in range(RANKS):
        path = log.with_name(f"run.dp{rank}.kvlog") if rank else log
        assert path.exists(), f"rank {rank} wrote no log at {path}"
        verified = _kvsched("verify", str(path))
        assert verified.returncode == 0, verified.stdout + verified.stderr
        replay = _kvsched("replay", str(path), "--json", "--quiet")
        requests.append(json.loads(replay.stdout)["requests"])
    assert sum(requests) == REQUESTS
    assert min(requests) >= 1  # vLLM's balancer, reading each scheduler's counts, used both


def test_vllm_data_parallel_ranks_publish_their_kv_events_on_their_own_port_tagged_by_rank(
    served,
):
    events = served["events"]
    assert served["seen"] == {events + r: {r} for r in range(RANKS)}
