"""Several vLLM servers under kvsched behind vllm-router (``kvsched.integrations.vllm.cluster``).

Three OpenAI servers on a tiny model, each publishing kvsched's cache as vLLM KV events, are
started once for the module. A kv_aware router and then a round_robin router serve the same
workload (shared prefixes computed on a known server, multi-turn sessions) with fresh prompts
each; then, behind a kv_aware router with fast health checks, one server is killed while
requests run on every server. The survivors are stopped and their kvsched logs verified.

Hybrid models (at the end, once those servers are stopped): what vllm-router's kv_aware
credits of a hybrid model's KV events, with fake workers fed the adapter's translator; then
two tiny Qwen3-Next servers under kvsched, where a prefix whose state lives on one server
only is followed there; then one of them is killed while requests run on both, and the
survivor's log is verified.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment: scripts/test_vllm.sh builds .venv-vllm",
)
pytest.importorskip("vllm_router", reason="vllm-router is not installed (the vllm-test extra)")

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.integrations.vllm import cluster as cl
from kvsched.integrations.vllm import cluster_workload as cw
from kvsched.integrations.vllm.models import build
from kvsched.replay.cluster import run_cluster
from kvsched.replay.workload import Turn, Workload

SERVERS = 3
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
LONG = 384  # decode tokens of the requests in flight when a server is killed


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3", tmp_path_factory.mktemp("qwen3") / "model")


@pytest.fixture(scope="module")
def cluster(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("cluster")
    with cl.Cluster(qwen3, SERVERS, out, env=CPU_ENV) as c:
        yield c.wait()


@pytest.fixture(scope="module")
def runs(cluster: cl.Cluster) -> dict[str, list[cw.Routed]]:
    """The workload under each policy over the same servers (new prompts for each)."""
    result = {}
    for seed, policy in enumerate(("kv_aware", "round_robin"), start=1):
        router = cluster.router(policy)
        result[policy] = cw.workload(cluster, router.url, seed)
        router.stop()
    return result


def test_vllm_router_kv_aware_sends_each_request_to_the_server_holding_its_prefix(runs):
    routed = runs["kv_aware"]
    held = [r for r in routed if r.holder is not None]
    assert [(r.name, r.reached) for r in held] == [(r.name, r.holder) for r in held]
    assert {r.holder for r in held} == set(range(SERVERS))  # prefixes on every server
    assert all(r.hits >= r.held > 0 for r in held)  # at least what the holder holds hit


def _what_if_picks(block_size: int, seed: int) -> list[int]:
    """The engines kvsched's cluster what-if (``replay.cluster``, route ``kv_aware``) sends the
    followers of ``shared_prefix_prompts`` to, the same prompts one at a time on as many
    simulated engines. Its router places each prefix's seed request itself: on an idle
    cluster, the engine sent fewest requests, which is the server the live run seeds
    directly (prefix ``p`` on server ``p``)."""
    turns, followers = [], []
    for i, (name, prompt) in enumerate(cw.shared_prefix_prompts(block_size, seed)):
        request = ev.RequestArrived(i, np.asarray(prompt, dtype=np.int32), 4, 0.0, eos_token_id=-1)
        turns.append(Turn(request, arrival_s=10.0 * i))
        if not name.endswith("-seed"):
            followers.append(i)
    config = SchedulerConfig(
        model=ModelSpec(vocab_size=512),
        block_size=block_size,
        num_blocks=256,
        max_batch=8,
        max_prefill_tokens=256,
    )
    engines = [Engine(config) for _ in range(SERVERS)]
    executors = [SimulatedExecutor(512) for _ in engines]
    run = run_cluster(engines, executors, Workload("router", tuple(turns)), "kv_aware")
    return [int(run.routed[i]) for i in followers]


def test_vllm_router_and_kvscheds_what_if_send_the_shared_prefixes_to_the_same_servers(
    runs, cluster
):
    live = [r.reached for r in runs["kv_aware"] if r.name.startswith("prefix")]
    assert live == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert _what_if_picks(cluster.block_size, seed=1) == live  # (the runs fixture's seed)


def test_vllm_router_kv_aware_gets_more_prefix_hits_than_round_robin_on_the_same_servers(runs):
    kv, rr = (cw.summary(runs[p]) for p in ("kv_aware", "round_robin"))
    print("kv_aware", kv, "\nround_robin", rr)  # (shown with -s)
    assert kv["requests"] == rr["requests"]
    assert kv["to_holder"] == kv["with_holder"] > rr["to_holder"]
    assert kv["hit_tokens"] > rr["hit_tokens"]
    assert len(set(rr["reached"])) == SERVERS  # round_robin did spread them


def _send(url: str, model: str, prompt: list[int], outcomes: dict[int, Any], key: int) -> None:
    try:
        outcomes[key] = cl.complete(url, model, prompt, LONG)
    except (urllib.error.URLError, OSError) as e:
        outcomes[key] = e


def _in_flight(cluster: cl.Cluster) -> list[float]:
    return [c["running"] + c["waiting"] if c else 0.0 for c in cluster.counters()]


def _arrivals(cluster: cl.Cluster, before: list[dict[str, float]]) -> tuple[list[float], float]:
    """Requests in flight (running or waiting) per server, and how many requests have
    arrived in all since ``before``: in flight or finished."""
    now = cluster.counters()
    in_flight = [c["running"] + c["waiting"] if c else 0.0 for c in now]
    finished = sum(c["finished"] - b["finished"] for c, b in zip(now, before, strict=True) if c)
    return in_flight, sum(in_flight) + finished


def _wait_for(
    reached: Any,
    what: str,
    cluster: cl.Cluster,
    router: cl.Router,
    threads: list[threading.Thread],
    outcomes: dict[int, Any],
    timeout: float = 120,
) -> None:
    """Until ``reached()``; fails at once, naming what the requests got, which servers are
    alive, the router's view of them and its output, if ``threads`` all ended first."""
    deadline = time.monotonic() + timeout
    while not reached():
        ended = not any(t.is_alive() for t in threads)
        if ended or time.monotonic() > deadline:
            alive = [e.alive() for e in cluster.engines]
            raise AssertionError(
                f"{what}: not reached ({'the requests ended' if ended else 'timed out'}; "
                f"in flight {_in_flight(cluster)}, servers alive {alive}, healthy to the "
                f"router {cl.worker_health(router.url)}): {outcomes}\n{router.tail()}"
            )
        time.sleep(0.05)


def _wait_workers_healthy(router: cl.Router, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(cl.worker_health(router.url).values()):
        assert time.monotonic() < deadline, f"workers not healthy: {router.tail()}"
        time.sleep(0.2)


def _wait_unhealthy(router_url: str, url: str, timeout: float = 60) -> float:
    start = time.monotonic()
    while cl.worker_health(router_url)[url]:
        assert time.monotonic() - start < timeout, "the router kept the dead server"
        time.sleep(0.2)
    return time.monotonic() - start


def _kill_one(cluster: cl.Cluster, prefix_blocks: int, seed: int) -> dict[str, Any]:
    """Two long requests per server (each sharing a prefix of ``prefix_blocks`` blocks held
    there) through a kv_aware router checking health every second; once one of the last
    server's own requests (sent after the others arrived) runs there, that server is
    SIGKILLed; then two more requests per prefix go through the router."""
    router = cluster.router("kv_aware", health_interval=1, failures=2)
    _wait_workers_healthy(router)
    victim, bs, servers = cluster.engines[-1], cluster.block_size, len(cluster.engines)
    prefixes = [cw.tokens(prefix_blocks * bs, seed + i) for i in range(servers)]
    for engine, prefix in zip(cluster.engines, prefixes, strict=True):
        cl.complete(engine.url, cluster.model, prefix + cw.tokens(8, seed + 100))
    outcomes: dict[int, Any] = {}
    threads = [
        threading.Thread(
            target=_send,
            args=(
                router.url,
                cluster.model,
                prefixes[k % servers] + cw.tokens(64, seed + 200 + k),
                outcomes,
                k,
            ),
        )
        for k in range(2 * servers)
    ]
    # The victim's requests go last, once the others have arrived (running, waiting or
    # already done: a fast server may finish one before the last is sent), so that one of
    # them surely runs on it when it is killed.
    others = [t for k, t in enumerate(threads) if k % servers != servers - 1]
    mine = [t for k, t in enumerate(threads) if k % servers == servers - 1]
    before = cluster.counters()
    for t in others:
        t.start()
    args = (cluster, router, others, outcomes)
    _wait_for(lambda: _arrivals(cluster, before)[1] >= len(others), "the others arrived", *args)
    for t in mine:
        t.start()
    counts: list[float] = []

    def victim_runs() -> bool:  # (and every request arrived)
        nonlocal counts
        counts, arrived = _arrivals(cluster, before)
        return counts[-1] >= 1 and arrived >= len(threads)

    _wait_for(victim_runs, "the victim's requests run there", cluster, router, mine, outcomes)
    victim.kill()
    for t in threads:
        t.join(timeout=300)
    unhealthy_after = _wait_unhealthy(router.url, victim.url)
    after = [
        cluster.send(router.url, prefixes[k % servers] + cw.tokens(64, seed + 300 + k))[0]
        for k in range(2 * servers)
    ]
    router.stop()
    return {
        "servers": servers,
        "in_flight": counts,
        "failed": sum(isinstance(o, Exception) for o in outcomes.values()),
        "served": sum(isinstance(o, dict) for o in outcomes.values()),
        "unhealthy_after": unhealthy_after,
        "after": after,
    }


def _assert_only_the_victims_requests_lost(killed: dict[str, Any]) -> None:
    print("kill", killed)
    servers, on_victim = killed["servers"], killed["in_flight"][-1]
    assert on_victim >= 1  # the kill did hit running requests
    assert killed["failed"] <= on_victim
    assert killed["served"] >= 2 * servers - on_victim
    assert killed["unhealthy_after"] < 30
    assert servers - 1 not in killed["after"]  # nothing reaches the dead server any more
    assert len(killed["after"]) == 2 * servers  # and every request sent since was served


@pytest.fixture(scope="module")
def killed(cluster: cl.Cluster, runs: Any) -> dict[str, Any]:
    return _kill_one(cluster, 4, 9000)


def test_vllm_router_loses_only_the_killed_servers_in_flight_requests_then_drops_it(killed):
    _assert_only_the_victims_requests_lost(killed)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsched.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def survivors(cluster: cl.Cluster, killed: Any) -> list[tuple[Path, float]]:
    """Each surviving server's log (complete once it stopped) and its /metrics prefix hits."""
    out = []
    for engine in cluster.engines[:-1]:
        hits = cl.counters(engine.url)["hits"]
        engine.stop()
        assert engine.log is not None
        out.append((engine.log, hits))
    return out


def test_vllm_router_survivors_logs_verify_and_count_the_hits_their_metrics_report(survivors):
    import json

    for log, hits in survivors:
        verify = _cli("verify", str(log))
        assert verify.returncode == 0 and "0 divergences" in verify.stdout, verify.stdout
        replay = json.loads(_cli("replay", str(log), "--json").stdout)
        print(log.name, "metrics hits", hits, "log hits", replay["hit_tokens"])
        assert replay["hit_tokens"] == hits > 0


# ---------------------------------------------------------------------------------- hybrid
#
# A hybrid model's KV cache groups, numbered as vLLM 0.32 numbers them for Qwen3-Next: 0-2
# mamba, 3 full attention. vllm-router's kv_aware scores group 0 only, walking a prompt's
# blocks from the first one. First with fake workers (an OpenAI endpoint that answers every
# completion, and a ZeroMQ publisher of hand-fed kvsched events: fast, and exact about what
# is credited), then with two tiny Qwen3-Next servers under kvsched.

FAKE_BLOCK = 4
HYBRID_GROUPS = (3, (0, 1, 2))  # (attention, mamba)


class FakeWorker:
    """Answers every ``/v1/completions`` (counting them) and ``GET`` (health, models) on a
    loopback port; publishes KV event batches on another, bound as vLLM binds."""

    def __init__(self) -> None:
        import zmq

        self.served = 0
        self.http = _fake_http(self)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.events_port = cl.free_port()
        self.pub: Any = zmq.Context.instance().socket(zmq.PUB)
        self.pub.bind(f"tcp://{cl.HOST}:{self.events_port}")
        self.seq = 0

    @property
    def url(self) -> str:
        return f"http://{cl.HOST}:{self.http.server_address[1]}"

    @property
    def events(self) -> str:
        return f"tcp://{cl.HOST}:{self.events_port}"

    def publish(self, events: list[Any]) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))
        self.pub.send_multipart((b"", self.seq.to_bytes(8, "big"), payload))
        self.seq += 1

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.pub.close(0)


def _fake_http(worker: FakeWorker) -> Any:
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply({"object": "list", "data": [{"id": "fake", "object": "model"}]})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            worker.served += 1
            choice = {"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            self._reply(
                {"id": "x", "object": "text_completion", "created": 0, "model": "fake"}
                | {"choices": [choice], "usage": usage}
            )

    return ThreadingHTTPServer((cl.HOST, 0), Handler)


class Feed:
    """kvsched's decisions about one prompt on one fake server, as the adapter's translator
    turns them into vLLM events (``kv_events.KVEventTranslator``, vLLM's event classes)."""

    def __init__(self, prompt: list[int]) -> None:
        import hashlib

        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        from kvsched.integrations.vllm.kv_events import EventGroups, KVEventTranslator

        factories = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}
        factories["AllBlocksCleared"] = AllBlocksCleared
        self.tr = KVEventTranslator(
            FAKE_BLOCK, maybe_convert_block_hash, factories, EventGroups(*HYBRID_GROUPS)
        )
        hashes = [
            hashlib.sha256(bytes(str(prompt[: (i + 1) * FAKE_BLOCK]), "ascii")).digest()
            for i in range(len(prompt) // FAKE_BLOCK)
        ]
        self.request = SimpleNamespace(block_hashes=hashes, all_token_ids=prompt)
        self.next_id = 0

    def _translate(self, decisions: list[Any]) -> list[Any]:
        return self.tr.translate(decisions, {1: self.request}.__getitem__)

    def attention(self, blocks: int) -> list[Any]:
        """``blocks`` attention blocks of the prompt enter the prefix index."""

        ids = [bytes([1, i]) * 8 for i in range(blocks)]
        cached = ev.BlocksCached(
            np.array([1], np.int64),
            np.array([blocks], np.int32),
            np.array([0], np.int32),
            np.arange(blocks, dtype=np.int32),
            np.zeros(blocks, np.int32),
            b"".join(ids),
            b"\0" * 16 + b"".join(ids[:-1]),
        )
        return self._translate([cached])

    def checkpoint(self, blocks: int) -> tuple[int, list[Any]]:
        """A state after ``blocks`` blocks is saved and published: its id and events."""
        from kvsched.events import types as ev

        self.next_id += 1
        i, n = self.next_id, blocks * FAKE_BLOCK
        reserved = ev.CheckpointReserved(i, 1, 3, n, bytes([2, i]) * 8, bytes(16))
        return i, self._translate([reserved, ev.CheckpointPublished(i)])

    def evict(self, ckpt_id: int) -> list[Any]:
        from kvsched.events import types as ev

        return self._translate([ev.CheckpointEvicted(ckpt_id)])


def old_form(events: list[Any]) -> list[Any]:
    """The stream as kvsched published it before chains: the one-block store in group 0 too
    (group 1's events, retagged)."""
    import msgspec

    group0 = [msgspec.structs.replace(e, group_idx=0) for e in events if e.group_idx == 1]
    return [e for e in events if e.group_idx != 0] + group0


@pytest.fixture(scope="module")
def fake_routing(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Scenarios over two fake servers A (0) and B (1) behind one kv_aware router: a fresh
    4-block prompt each, states published on both, then which server 3 requests extending
    the prompt (or sharing only its first 2 blocks: "partial") reach. A idle router sends a
    request no server is credited for to B (measured), so A is the one to earn requests."""
    out = tmp_path_factory.mktemp("fake")
    workers = [FakeWorker(), FakeWorker()]
    port = cl.free_port()
    cmd = cl.router_command(workers, port, "kv_aware", FAKE_BLOCK, "fake")  # type: ignore[arg-type]
    p = cl.Process.spawn("router-fake", cmd, out / "router.out", dict(os.environ))
    router = cl.Router(p.name, p.cmd, p.out, p.proc, port)
    result: dict[str, list[int]] = {}
    try:
        cl.wait_healthy(router, timeout=120)
        time.sleep(2)  # (the router's subscribers connect)

        def reached(name: str, a: list[Any], b: list[Any], prompt: list[int], share: int) -> None:
            for worker, events in zip(workers, (a, b), strict=True):
                if events:
                    worker.publish(events)
            time.sleep(1)  # (the router folds them)
            got = []
            for r in range(3):
                before = [w.served for w in workers]
                body = prompt[: share * FAKE_BLOCK] + cw.tokens(FAKE_BLOCK + 1, 50 + r)
                cl.complete(router.url, "fake", body, 1)
                got += [i for i, w in enumerate(workers) if w.served > before[i]]
            result[name] = got

        for k, name in enumerate(("chain", "old form", "attention only")):
            prompt = cw.tokens(4 * FAKE_BLOCK, 100 + k)
            a, b = Feed(prompt), Feed(prompt)
            state = a.checkpoint(3)[1]
            events = {"chain": state, "old form": old_form(state), "attention only": []}[name]
            reached(name, a.attention(4) + events, b.checkpoint(1)[1], prompt, 4)

        prompt = cw.tokens(4 * FAKE_BLOCK, 200)
        a, b = Feed(prompt), Feed(prompt)
        (deep, a_deep), (shallow, a_shallow) = a.checkpoint(3), a.checkpoint(2)
        reached("A: 3 and 2, B: 1", a_deep + a_shallow, b.checkpoint(1)[1], prompt, 4)
        reached("A: 2 (3 evicted), B: 1", a.evict(deep), [], prompt, 4)
        reached("A: none (2 evicted), B: 1", a.evict(shallow), [], prompt, 4)

        prompt = cw.tokens(4 * FAKE_BLOCK, 300)
        a, b = Feed(prompt), Feed(prompt)
        reached("partial: A 3, B 1", a.checkpoint(3)[1], b.checkpoint(1)[1], prompt, 2)
    finally:
        router.stop()
        for w in workers:
            w.close()
    print("fake routing", result)
    return result


def test_vllm_router_sends_a_hybrid_prefix_to_the_server_whose_state_chain_is_deepest(
    fake_routing,
):
    assert fake_routing["chain"] == [0, 0, 0]  # A: state after 3 blocks; B: after 1


def test_vllm_router_credits_neither_attention_blocks_nor_one_block_states_of_a_hybrid(
    fake_routing,
):
    # the same caches, announced as attention blocks (group 3) only, or with kvsched's former
    # one-block checkpoint stores: A's 3-block state is not seen, B's chain wins
    assert fake_routing["attention only"] == fake_routing["old form"] == [1, 1, 1]


def test_vllm_router_stops_crediting_a_chain_when_its_last_covering_state_goes(fake_routing):
    assert fake_routing["A: 3 and 2, B: 1"] == [0, 0, 0]
    assert fake_routing["A: 2 (3 evicted), B: 1"] == [0, 0, 0]  # the state after 2 still lives
    assert fake_routing["A: none (2 evicted), B: 1"] == [1, 1, 1]


def test_vllm_router_credits_a_partly_shared_chain_although_the_state_lies_deeper(fake_routing):
    # the cost of chains: 2 shared blocks credit A (state after 3) over B (state after 1),
    # although A's state cannot serve this prompt and B's can
    assert fake_routing["partial: A 3, B 1"] == [0, 0, 0]


HYBRID_SERVERS = 2  # (the fixture pairs server 0 with server 1)
FOLLOWERS = 3


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3-next", tmp_path_factory.mktemp("qwen3next") / "model")


@pytest.fixture(scope="module")
def hybrid_cluster(qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("hybrid")
    block, args = cl.HYBRID_BLOCK_SIZE, cl.HYBRID_SERVE_ARGS
    with cl.Cluster(qwen3_next, HYBRID_SERVERS, out, block, args, env=CPU_ENV) as c:
        yield c.wait()


def _group0_stores(listener: Any) -> list[Any]:
    """The group-0 stores a server has published so far (vLLM's own schema, strictly)."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events = [e for _, payload in list(listener.messages) for e in decoder.decode(payload).events]
    return [e for e in events if isinstance(e, BlockStored) and e.group_idx == 0]


def _state_on(listener: Any, prefix: list[int], timeout: float = 120) -> tuple[int, Any]:
    """Once a server announced a state on ``prefix``: the tokens of the deepest one (a
    group-0 chain whose token ids begin ``prefix``) and that store."""
    deadline = time.monotonic() + timeout
    while True:
        on = [e for e in _group0_stores(listener) if e.token_ids == prefix[: len(e.token_ids)]]
        if on:
            time.sleep(1)  # (and any deeper one announced by the same step)
            on = [e for e in _group0_stores(listener) if e.token_ids == prefix[: len(e.token_ids)]]
            deepest = max(on, key=lambda e: len(e.token_ids))
            return len(deepest.token_ids), deepest
        assert time.monotonic() < deadline, "no state announced on the prefix"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def hybrid_routed(hybrid_cluster: cl.Cluster) -> dict[str, list[dict[str, Any]]]:
    """Per policy (kv_aware, then round_robin, each with prompts of its own), for each server
    in turn (the holder): the other server computes the prefix's first block (plus a short
    tail), the holder the whole 3-block prefix, directly; once both announced their states,
    ``FOLLOWERS`` requests extending the prefix (each its own 64-token tail) go through the
    router, one at a time. The state after 3 blocks then lives on the holder only; the other
    server's shallower state makes reaching the holder a matter of credit, not of how the
    router breaks ties."""
    from kvsched.integrations.vllm.listen import Listener

    c = hybrid_cluster
    listeners = [Listener(connect=e.events) for e in c.engines]
    for listener in listeners:
        listener.__enter__()
    try:
        out = {
            policy: _hybrid_followers(c, listeners, policy, 7000 + 1000 * k)
            for k, policy in enumerate(("kv_aware", "round_robin"))
        }
    finally:
        for listener in listeners:
            listener.__exit__(None, None, None)
    print("hybrid routed", out)
    return out


def _hybrid_followers(
    c: cl.Cluster, listeners: list[Any], policy: str, seed: int
) -> list[dict[str, Any]]:
    bs, router, out = c.block_size, c.router(policy), []
    try:
        for holder, engine in enumerate(c.engines):
            prefix, other = cw.tokens(3 * bs, seed + holder), 1 - holder
            cl.complete(
                c.engines[other].url, c.model, prefix[:bs] + cw.tokens(8, seed + 50 + holder)
            )
            cl.complete(engine.url, c.model, prefix + cw.tokens(8, seed + 100 + holder))
            shallow, _ = _state_on(listeners[other], prefix)
            state, store = _state_on(listeners[holder], prefix)
            for f in range(FOLLOWERS):
                before = c.counters()
                prompt = prefix + cw.tokens(64, seed + 200 + 10 * holder + f)
                reached, _ = c.send(router.url, prompt)
                hits = c.hits_since(reached, before)
                out.append(
                    {"holder": holder, "state": state, "other": shallow, "reached": reached}
                    | {"hits": hits}
                )
            out[-1]["store"] = (len(store.block_hashes), store.block_size, store.parent_block_hash)
    finally:
        router.stop()
    return out


def test_vllm_router_sends_requests_sharing_a_hybrid_prefix_to_the_one_server_with_its_state(
    hybrid_routed,
):
    routed = hybrid_routed["kv_aware"]
    assert {r["holder"] for r in routed} == set(range(HYBRID_SERVERS))
    assert [r["reached"] for r in routed] == [r["holder"] for r in routed]
    assert all(r["hits"] == r["state"] > r["other"] > 0 for r in routed)  # resumed there


def test_vllm_router_kv_aware_resumes_more_hybrid_tokens_than_round_robin_on_the_same_servers(
    hybrid_routed,
):
    kv, rr = hybrid_routed["kv_aware"], hybrid_routed["round_robin"]
    assert len(kv) == len(rr) == HYBRID_SERVERS * FOLLOWERS
    assert sum(r["reached"] != r["holder"] for r in rr) > 0  # round robin misses the state
    assert sum(r["hits"] for r in kv) > sum(r["hits"] for r in rr)


def test_vllm_router_sees_a_hybrid_servers_state_as_its_chain_from_the_first_block(
    hybrid_routed,
):
    bs = cl.HYBRID_BLOCK_SIZE
    for r in hybrid_routed["kv_aware"][FOLLOWERS - 1 :: FOLLOWERS]:
        assert r["store"] == (r["state"] // bs, bs, None)  # every block to the state's, no parent


@pytest.fixture(scope="module")
def hybrid_killed(hybrid_cluster: cl.Cluster, hybrid_routed: Any) -> dict[str, Any]:
    return _kill_one(hybrid_cluster, 2, 9500)


def test_vllm_router_loses_only_the_killed_hybrid_servers_in_flight_requests_then_drops_it(
    hybrid_killed,
):
    _assert_only_the_victims_requests_lost(hybrid_killed)


@pytest.fixture(scope="module")
def hybrid_logs(hybrid_cluster: cl.Cluster, hybrid_killed: Any) -> list[tuple[Path, float]]:
    """The surviving hybrid server's log (complete once it stopped) and its /metrics prefix
    hits."""
    out = []
    for engine in hybrid_cluster.engines[:-1]:
        hits = cl.counters(engine.url)["hits"]
        engine.stop()
        assert engine.log is not None
        out.append((engine.log, hits))
    return out


def test_vllm_router_hybrid_servers_logs_verify_and_count_the_hits_their_metrics_report(
    hybrid_logs,
):
    import json

    for log, hits in hybrid_logs:
        verify = _cli("verify", str(log))
        assert verify.returncode == 0 and "0 divergences" in verify.stdout, verify.stdout
        replay = json.loads(_cli("replay", str(log), "--json").stdout)
        print(log.name, "metrics hits", hits, "log hits", replay["hit_tokens"])
        assert replay["hit_tokens"] == hits > 0
