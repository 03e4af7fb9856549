"""Several vLLM servers under kvsched behind a KV-aware router (``vllm-router``), on loopback.

    python -m kvsched.integrations.vllm.cluster MODEL --servers 2 --policy kv_aware

starts ``--servers`` OpenAI servers (``vllm.entrypoints.openai.api_server``) with kvsched as
their scheduler, each writing its own kvsched event log and publishing its cache as vLLM KV
events over ZeroMQ, and one ``vllm-router`` in front of them that follows those events
(``--kv-event-source`` per server). It prints the URLs and each server's prefix-cache counters
when stopped (Ctrl-C). ``--compare`` instead runs a small shared-prefix / multi-turn workload
through a kv_aware and a round_robin router over the same servers and prints where each
request went (docs/several-engines.md). ``--hybrid`` serves a hybrid model (Qwen3-Next:
``HYBRID_SERVE_ARGS``, block ``HYBRID_BLOCK_SIZE``), whose states kv_aware follows through
kvsched's checkpoint chains in KV cache group 0 (``kv_events.py``).

Two details decide whether the router sees anything:

* vLLM's ZeroMQ publisher binds only an endpoint with ``*`` or ``::`` in it and *connects*
  to any other (``ZmqEventPublisher._is_bind_endpoint``), and the router's subscriber
  connects too, so with ``tcp://127.0.0.1:PORT`` on both sides nobody listens and no event
  arrives. ``tcp://[::ffff:127.0.0.1]:PORT`` (the IPv4-mapped loopback) makes vLLM bind, and
  ZeroMQ binds it as ``127.0.0.1:PORT``: loopback only. The router connects to
  ``tcp://127.0.0.1:PORT`` (it accepts only ``tcp://HOST:PORT``).
* The topic stays vLLM's default, empty one.

The router hashes a request's token ids per block, so requests are sent as token-id prompts
(``"prompt": [ids]`` on ``/v1/completions``). This module only spawns processes and speaks
HTTP: it imports neither vLLM nor the router.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
SCHEDULER = "kvsched.integrations.vllm.Scheduler"
REQUEST_CHECK = "kvsched.integrations.vllm:RequestCheck"
# the settings of the tested servers (tiny CPU models): eager, small batches
SERVE_ARGS = (
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--max-num-batched-tokens",
    "256",
    "--max-num-seqs",
    "8",
)
# a hybrid model (Qwen3-Next): vLLM sizes its block as the state page, 640 tokens for the tiny
# model with float32 states (models.STATE_DTYPE); the step budget must hold a block
HYBRID_BLOCK_SIZE = 640
HYBRID_SERVE_ARGS = (
    "--enforce-eager",
    "--max-model-len",
    "4096",
    "--max-num-batched-tokens",
    "4096",
    "--max-num-seqs",
    "4",
    "--mamba-ssm-cache-dtype",
    "float32",
)
COUNTERS = {  # /metrics name -> our name (summed over the engine's label sets)
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:request_success_total": "finished",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}


# Ports are picked below Linux's default ephemeral range (32768-60999): a port the kernel
# hands out itself (to a connection, or a bind to port 0, e.g. inside a starting server) can
# no longer take one between its choice and the server's bind (measured: a server's KV
# events endpoint, "Address already in use", with three servers starting together).
PORTS = range(20000, 32768)
_given: set[int] = set()


def free_port() -> int:
    """A loopback port free now, outside the ephemeral range, not given before here."""
    for port in random.sample(PORTS, len(PORTS)):
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {PORTS}")


def kv_events_config(port: int, topic: str = "") -> str:
    """``--kv-events-config`` publishing on ``127.0.0.1:port`` (bound: see the module doc)."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://[::ffff:{HOST}]:{port}",
            "topic": topic,
        }
    )


def serve_command(
    model: str,
    port: int,
    events_port: int,
    block_size: int = 32,
    kvsched: bool = True,
    extra: Sequence[str] = SERVE_ARGS,
    python: str = sys.executable,
) -> list[str]:
    """One OpenAI server with prefix caching and KV events (under kvsched unless told not)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    if kvsched:
        cmd += ["--scheduler-cls", SCHEDULER, "--logits-processors", REQUEST_CHECK]
    return [
        *cmd,
        "--host",
        HOST,
        "--port",
        str(port),
        "--block-size",
        str(block_size),
        "--enable-prefix-caching",
        "--kv-events-config",
        kv_events_config(events_port),
        *extra,
    ]


@dataclass
class Process:
    """A spawned process in its own process group, its output in a file."""

    name: str
    cmd: list[str]
    out: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    @classmethod
    def spawn(cls, name: str, cmd: list[str], out: Path, env: dict[str, str]) -> Process:
        with open(out, "wb") as f:
            proc = subprocess.Popen(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        return cls(name, cmd, out, proc)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 4000) -> str:
        return self.out.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL the whole group (the server and its engine core): a crash."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if not self.alive():
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Engine(Process):
    """One vLLM server: its HTTP port, its KV events port and its kvsched log."""

    port: int = 0
    events_port: int = 0
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def events(self) -> str:
        """Where a subscriber connects for this server's KV events."""
        return f"tcp://{HOST}:{self.events_port}"


@dataclass
class Router(Process):
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def router_command(
    engines: Sequence[Engine],
    port: int,
    policy: str = "kv_aware",
    block_size: int = 32,
    model: str | None = None,
    health_interval: int = 60,
    health_failures: int = 3,
    python: str = sys.executable,
) -> list[str]:
    """``vllm-router`` over ``engines``; kv_aware follows each one's KV events."""
    cmd = [python, "-m", "vllm_router.launch_router", "--host", HOST, "--port", str(port)]
    cmd += ["--policy", policy, "--worker-urls", *[e.url for e in engines]]
    if policy == "kv_aware":
        for e in engines:
            cmd += ["--kv-event-source", f"{e.url}={e.events}"]
        cmd += ["--kv-event-block-size", str(block_size)]
        if model:
            cmd += ["--kv-event-model", model]
    return [
        *cmd,
        "--prometheus-port",
        str(free_port()),
        "--prometheus-host",
        HOST,
        "--health-check-interval-secs",
        str(health_interval),
        "--health-failure-threshold",
        str(health_failures),
        "--health-success-threshold",
        "1",
    ]


# ----------------------------------------------------------------------------- HTTP


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
    return body


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def healthy(url: str) -> bool:
    try:
        get(url + "/health", timeout=2)
        return True
    except (OSError, urllib.error.URLError):
        return False


def wait_healthy(p: Engine | Router, timeout: float = 600) -> None:
    """Until ``p`` answers /health; RuntimeError (with its output) if it dies or times out."""
    deadline = time.monotonic() + timeout
    while not healthy(p.url):
        if not p.alive():
            raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{p.name} not healthy after {timeout}s:\n{p.tail()}")
        time.sleep(0.5)


def counters(url: str) -> dict[str, float]:
    """A server's prefix-cache and request counters from its /metrics (see ``COUNTERS``)."""
    text = get(url + "/metrics").decode()
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for name, ours in COUNTERS.items():
        for value in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M):
            out[ours] += float(value)
    return out


def worker_health(router_url: str) -> dict[str, bool]:
    """The router's view: worker URL -> healthy (``GET /workers``)."""
    workers = json.loads(get(router_url + "/workers"))["workers"]
    return {w["url"]: bool(w["is_healthy"]) for w in workers}


def complete(url: str, model: str, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    """A greedy token-id completion with its tokens' texts (``logprobs: 0``). Only fields
    vllm-router's own request type knows: a body with any other field (vLLM's
    ``return_token_ids`` or ``return_tokens_as_token_ids`` among them) is routed by kv_aware
    with no prefix credited at all."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    return post(url + "/v1/completions", body)


def vocabulary(model: str | Path) -> dict[str, int]:
    """Token text -> id from the model's ``tokenizer.json`` (a word-level vocabulary, as the
    tiny test models': the texts ``logprobs`` reports are its entries)."""
    tokenizer = json.loads((Path(model) / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    return vocab


def answer_ids(response: dict[str, Any], vocab: dict[str, int]) -> list[int]:
    """The generated token ids of a ``complete`` response (KeyError: not a vocabulary word)."""
    return [vocab[t] for t in response["choices"][0]["logprobs"]["tokens"]]


# ----------------------------------------------------------------------------- cluster


class Cluster:
    """``servers`` vLLM servers under kvsched (started together) and the routers put in
    front of them; ``close`` stops everything still running."""

    def __init__(
        self,
        model: str | Path,
        servers: int,
        out: Path,
        block_size: int = 32,
        serve_args: Sequence[str] = SERVE_ARGS,
        kvsched: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model, self.block_size, self.out = str(model), block_size, out
        self.env = {**os.environ, **(env or {})}
        self.engines: list[Engine] = []
        self.routers: list[Router] = []
        out.mkdir(parents=True, exist_ok=True)
        for i in range(servers):
            self.engines.append(self._spawn_engine(i, serve_args, kvsched))

    def _spawn_engine(self, i: int, serve_args: Sequence[str], kvsched: bool) -> Engine:
        port, events_port, log = free_port(), free_port(), self.out / f"server{i}.kvlog"
        cmd = serve_command(self.model, port, events_port, self.block_size, kvsched, serve_args)
        env = {**self.env, "KVSCHED_VLLM_LOG": str(log)} if kvsched else self.env
        p = Process.spawn(f"server{i}", cmd, self.out / f"server{i}.out", env)
        return Engine(p.name, cmd, p.out, p.proc, port, events_port, log if kvsched else None)

    def wait(self, timeout: float = 600) -> Cluster:
        for e in self.engines:
            wait_healthy(e, timeout)
        return self

    def router(
        self, policy: str, port: int | None = None, health_interval: int = 60, failures: int = 3
    ) -> Router:
        """Start a router with ``policy`` over every server; returns once it is healthy."""
        port = port or free_port()
        cmd = router_command(
            self.engines, port, policy, self.block_size, self.model, health_interval, failures
        )
        name = f"router-{policy}-{len(self.routers)}"
        p = Process.spawn(name, cmd, self.out / f"{name}.out", self.env)
        router = Router(p.name, cmd, p.out, p.proc, port)
        self.routers.append(router)
        wait_healthy(router, timeout=120)
        return router

    def counters(self) -> list[dict[str, float]]:
        return [counters(e.url) if e.alive() else {} for e in self.engines]

    def hits_since(self, i: int, before: list[dict[str, float]]) -> float:
        """Server ``i``'s prefix-hit tokens since ``before`` (a ``counters()`` snapshot)."""
        return counters(self.engines[i].url)["hits"] - before[i]["hits"]

    def send(self, url: str, prompt: list[int], max_tokens: int = 4) -> tuple[int, dict[str, Any]]:
        """Send one request to ``url`` with nothing else in flight; returns the index of the
        server that finished it (its finished-request counter moved) and the response."""
        before = self.counters()
        response = complete(url, self.model, prompt, max_tokens)
        after = self.counters()
        moved = [
            i
            for i, (a, b) in enumerate(zip(after, before, strict=True))
            if a and a["finished"] > b["finished"]
        ]
        if len(moved) != 1:
            raise RuntimeError(f"cannot tell which server served the request: {moved}")
        return moved[0], response

    def close(self) -> None:
        for p in [*self.routers, *self.engines]:
            p.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- main


def _serve(cluster: Cluster, policy: str, port: int) -> None:
    router = cluster.router(policy, port)
    print(f"router ({policy}): {router.url}")
    for e in cluster.engines:
        print(f"  {e.name}: {e.url}  KV events {e.events}  log {e.log}")
    print("Ctrl-C stops everything")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    for e in cluster.engines:
        print(e.name, json.dumps(counters(e.url)))


def _compare(cluster: Cluster) -> None:
    from kvsched.integrations.vllm.cluster_workload import summary, workload  # (imports us)

    result = {}
    for seed, policy in enumerate(("kv_aware", "round_robin"), start=1):
        router = cluster.router(policy)
        result[policy] = summary(workload(cluster, router.url, seed))
        router.stop()
    print(json.dumps(result, indent=1))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m kvsched.integrations.vllm.cluster", description=__doc__.split("\n")[0]
    )
    ap.add_argument("model")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--policy", default="kv_aware", help="the router's --policy")
    ap.add_argument("--port", type=int, default=30000, help="the router's port")
    ap.add_argument("--block-size", type=int, default=None, help="default: 32; --hybrid: 640")
    ap.add_argument(
        "--hybrid", action="store_true", help="a hybrid model (Qwen3-Next): HYBRID_SERVE_ARGS"
    )
    ap.add_argument("--out", type=Path, default=Path("cluster"), help="logs and outputs")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="run the demo workload under kv_aware and "
        "round_robin and print where each request went",
    )
    args = ap.parse_args(argv)
    block_size = args.block_size or (HYBRID_BLOCK_SIZE if args.hybrid else 32)
    serve_args = HYBRID_SERVE_ARGS if args.hybrid else SERVE_ARGS
    with Cluster(args.model, args.servers, args.out, block_size, serve_args) as cluster:
        cluster.wait()
        if args.compare:
            _compare(cluster)
        else:
            _serve(cluster, args.policy, args.port)


if __name__ == "__main__":
    main()
