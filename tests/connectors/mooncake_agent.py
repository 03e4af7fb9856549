"""Runs Mooncake scenarios inside a private network namespace (started by conftest.py as
``unshare -rn sh -c 'ip link set lo up && exec python3 mooncake_agent.py'``).

Protocol on the original stdout (fd 1 is redirected to stderr so Mooncake's own output cannot
corrupt it): one JSON line ``{"ready": true}`` or ``{"skip": reason}``; then for each request
line ``{"scenario": name}`` on stdin one reply ``{"ok": bool, "error": traceback, "info": {}}``.
Scenarios share one cluster and one client; the fault scenarios start private clusters.
``--reader`` runs process B of the two-process scenario, ``--engine`` engine B of the
engine-sharing scenarios.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.connectors

import numpy as np
from tests.connectors.helpers import BLOCK_BYTES, chain, filled_buffer, save_chain

from kvsched.connectors import (
    HostBlockBuffer,
    HostStateBuffer,
    LoadOrder,
    LookupRequest,
    LookupResult,
    RpcFailed,
    StoreConnector,
    StoreTimeout,
    StoreUnavailable,
    TransferEngine,
    TransferFailed,
    block_key,
    state_key,
)
from kvsched.connectors.mooncake_cluster import MooncakeCluster
from kvsched.events.types import KVLoadStarted

Info = dict[str, Any]


class Context:
    def __init__(self) -> None:
        self.cluster = MooncakeCluster.start()
        self._store: Any = None

    @property
    def store(self) -> Any:
        if self._store is None:
            from kvsched.connectors.mooncake_store import MooncakeStore

            self._store = MooncakeStore(self.cluster.master_address, timeout_s=5.0)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self.cluster.stop()


def _load(store: Any, keys: list[str], n_blocks: int, timeout_s: float = 10.0) -> tuple:
    dst = HostBlockBuffer(n_blocks, BLOCK_BYTES)
    engine = TransferEngine(store, dst, batch_blocks=4, job_timeout_s=timeout_s)
    t0 = time.monotonic()
    engine.start_load(1, keys, list(range(len(keys))))
    report = engine.poll()
    while report.is_empty:
        assert time.monotonic() - t0 < timeout_s + 5, "load neither finished nor failed"
        time.sleep(0.005)
        report = engine.poll()
    engine.close()
    return dst, report, time.monotonic() - t0


# ----------------------------------------------------------------------------- scenarios


def round_trip(ctx: Context) -> Info:
    store = ctx.store
    root, hashes = chain(12, seed=11)
    src = filled_buffer(12, seed=12)
    save_chain(store, root, hashes, src, list(range(12)))
    dst, report, elapsed = _load(store, [block_key(root, h) for h in hashes], 12)
    assert report.finished_loads == {1}, report
    assert np.array_equal(dst.data, src.data)
    # state checkpoints
    states = HostStateBuffer(2, 100, 3000)
    states.conv[1], states.recurrent[1] = 5, 9
    engine = TransferEngine(store, src, states)
    engine.start_save(1, [], [], state=(state_key(root, hashes[-1]), 1))
    assert engine.wait_idle() and engine.poll().finished_saves == {1}
    back = HostStateBuffer(1, 100, 3000)
    loader = TransferEngine(store, HostBlockBuffer(1, BLOCK_BYTES), back)
    loader.start_load(2, [], [], state=(state_key(root, hashes[-1]), 0))
    assert loader.wait_idle() and loader.poll().finished_loads == {2}
    assert back.read_state(0) == states.read_state(1)
    # byte-level semantics
    assert store.get_many(["kvsched-test/absent"]) == [None]
    store.put_many([("kvsched-test/x", b"first")])
    store.put_many([("kvsched-test/x", b"second")])  # first writer wins
    assert store.get_many(["kvsched-test/x"]) == [b"first"]
    store.remove(["kvsched-test/x", "kvsched-test/absent"])
    assert store.batch_exists(["kvsched-test/x"]) == [False]
    return {"load_s": round(elapsed, 4)}


def lookup_leading(ctx: Context) -> Info:
    store = ctx.store
    root, hashes = chain(8, seed=21)
    store.put_many([(block_key(root, hashes[i]), b"v") for i in (0, 1, 2, 4, 5, 6)])
    store.put_many([(state_key(root, hashes[1]), b"s")])
    conn = StoreConnector(store, synchronous=True)
    req = LookupRequest(seq_id=1, namespace_root=root, block_hashes=tuple(hashes))
    assert conn.lookup(req) == LookupResult(3)
    with_state = LookupRequest(
        seq_id=2, namespace_root=root, block_hashes=tuple(hashes), with_state=True
    )
    assert conn.lookup(with_state) == LookupResult(2)
    other_root, other = chain(8, seed=21, salt="other")
    miss = LookupRequest(seq_id=3, namespace_root=other_root, block_hashes=tuple(other))
    assert conn.lookup(miss) == LookupResult(0)
    return {}


def missing_and_failing_blocks(ctx: Context) -> Info:
    store = ctx.store
    root, hashes = chain(10, seed=31)
    src = filled_buffer(10, seed=32)
    save_chain(store, root, hashes, src, list(range(10)))
    store.remove([block_key(root, hashes[6])])
    dst, report, _ = _load(store, [block_key(root, h) for h in hashes], 10)
    good, reason = report.failed_loads[1]
    assert good == 6 and "missing" in reason, report
    assert np.array_equal(dst.data[:6], src.data[:6]) and not dst.data[6:].any()
    return {}


def holder_killed_during_load(ctx: Context) -> Info:
    with MooncakeCluster.start(client_ttl_s=2) as cluster:
        from kvsched.connectors.mooncake_store import MooncakeStore

        store = MooncakeStore(cluster.master_address, timeout_s=2.0)
        root, hashes = chain(8, seed=41)
        src = filled_buffer(8, seed=42)
        save_chain(store, root, hashes, src, list(range(8)))
        keys = [block_key(root, h) for h in hashes]
        cluster.kill_holder()
        _, report, elapsed = _load(store, keys, 8, timeout_s=5.0)
        good, reason = report.failed_loads[1]
        # TRANSFER_FAIL until the master's client TTL (2 s) drops the holder's keys, then
        # the keys are simply missing; on a loaded machine either can be seen.
        assert good == 0 and ("TRANSFER_FAIL" in reason or "missing" in reason), report
        assert elapsed < 5.0
        try:
            assert store.get_many(keys[:1]) == [None], "a read from a dead holder succeeded"
        except TransferFailed as exc:
            assert exc.code == -800 and exc.name == "TRANSFER_FAIL"
        store.close()
        return {"load_fail_s": round(elapsed, 3), "reason": reason}


def master_killed_during_load(ctx: Context) -> Info:
    with MooncakeCluster.start() as cluster:
        from kvsched.connectors.mooncake_store import MooncakeStore

        store = MooncakeStore(cluster.master_address, timeout_s=2.0)
        root, hashes = chain(8, seed=51)
        save_chain(store, root, hashes, filled_buffer(8, seed=52), list(range(8)))
        keys = [block_key(root, h) for h in hashes]
        cluster.kill_master()
        # Depending on timing the client gets RPC_FAIL (-900) at once or keeps reconnecting
        # inside Mooncake, which the adapter's deadline turns into StoreTimeout.
        unavailable = ("RPC_FAIL", "did not return within", "still blocked")
        _, report, elapsed = _load(store, keys, 8, timeout_s=5.0)
        good, reason = report.failed_loads[1]
        assert good == 0 and any(u in reason for u in unavailable), report
        assert elapsed < 5.0
        try:
            store.batch_exists(keys)
            raise AssertionError("batch_exists succeeded without a master")
        except RpcFailed as exc:
            assert exc.code in (-900, -901)
        except StoreUnavailable:
            pass
        conn = StoreConnector(store, synchronous=True)
        request = LookupRequest(seq_id=1, namespace_root=root, block_hashes=tuple(hashes))
        answer = conn.lookup(request)
        assert isinstance(answer, LookupResult) and answer.num_blocks == 0
        assert any(u in answer.reason for u in unavailable), answer
        store.close()
        return {"load_fail_s": round(elapsed, 3), "reason": reason}


def master_frozen_during_load(ctx: Context) -> Info:
    with MooncakeCluster.start() as cluster:
        from kvsched.connectors.mooncake_store import MooncakeStore

        store = MooncakeStore(cluster.master_address, timeout_s=1.0)
        root, hashes = chain(4, seed=61)
        save_chain(store, root, hashes, filled_buffer(4, seed=62), list(range(4)))
        keys = [block_key(root, h) for h in hashes]
        store.remove(keys[1:2])  # the load must ask the master about the missing block
        os.kill(cluster.master.pid, signal.SIGSTOP)  # alive but silent: calls block ~30 s
        try:
            _, report, elapsed = _load(store, keys, 4, timeout_s=5.0)
            good, reason = report.failed_loads[1]
            assert good <= 1 and "did not return within" in reason, report
            assert elapsed < 3.0
            try:
                store.batch_exists(keys)
                raise AssertionError("batch_exists returned from a frozen master")
            except StoreTimeout:
                pass
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)
        store.close()
        return {"load_fail_s": round(elapsed, 3), "reason": reason}


def two_processes_share_blocks(ctx: Context) -> Info:
    store = ctx.store
    root, hashes = chain(16, seed=71)
    src = filled_buffer(16, seed=72)
    save_chain(store, root, hashes, src, list(range(16)))
    job = {
        "master": ctx.cluster.master_address,
        "root": root.hex(),
        "hashes": [h.hex() for h in hashes],
    }
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, __file__, "--reader"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["num_blocks"] == 16, out
    assert out["sha256"] == hashlib.sha256(src.data.tobytes()).hexdigest()
    return {"reader_s": round(time.monotonic() - t0, 3)}


def reader_main() -> None:
    """Process B: look the chain up and load it; print the digest of what it loaded."""
    from kvsched.connectors.mooncake_store import MooncakeStore

    job = json.loads(sys.stdin.read())
    store = MooncakeStore(job["master"])
    root, hashes = bytes.fromhex(job["root"]), [bytes.fromhex(h) for h in job["hashes"]]
    conn = StoreConnector(store)
    req = LookupRequest(seq_id=1, namespace_root=root, block_hashes=tuple(hashes))
    deadline = time.monotonic() + 10
    while not isinstance(answer := conn.lookup(req), LookupResult):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    n = answer.num_blocks
    blob = b"".join(hashes[:n])
    load = LoadOrder.from_event(KVLoadStarted(1, np.arange(n, dtype=np.int32), 0, root, blob))
    dst = HostBlockBuffer(len(hashes), BLOCK_BYTES)
    engine = TransferEngine(store, dst)
    engine.start_load(load.seq_id, load.keys, load.block_ids)
    assert engine.wait_idle(10)
    report = engine.poll()
    assert report.finished_loads == {1}, report
    digest = hashlib.sha256(dst.data.tobytes()).hexdigest()
    conn.close()
    store.close()
    print(json.dumps({"num_blocks": answer.num_blocks, "sha256": digest}), flush=True)


# ----------------------------------------------------------------- engines sharing a store

ENGINE_PROMPT_TOKENS = 250  # 15 full 16-token blocks and a 10-token suffix
ENGINE_MAX_TOKENS = 6


def engines_share_prefix_attention(ctx: Context) -> Info:
    return _engines_share_prefix(ctx, hybrid=False)


def engines_share_prefix_hybrid(ctx: Context) -> Info:
    return _engines_share_prefix(ctx, hybrid=True)


def _engines_share_prefix(ctx: Context, hybrid: bool) -> Info:
    """Engine A (this process) serves a prompt and saves it to the store; engine B (a second
    process with its own Mooncake client) serves the same prompt; a cold engine (no store)
    serves it too. Returns what each did (see ``serve_prompt``)."""
    from kvsched.gpu.fixtures import TINY_CONFIG, build_tiny_model

    attention_only = {"layer_types": ["full_attention"] * TINY_CONFIG["num_hidden_layers"]}
    rng = np.random.default_rng(81)
    prompt = rng.integers(1, TINY_CONFIG["vocab_size"], ENGINE_PROMPT_TOKENS).tolist()
    with tempfile.TemporaryDirectory(prefix="kvsched-tiny-") as tmp:
        model_dir, _ = build_tiny_model(tmp, seed=0, **({} if hybrid else attention_only))
        job = {"model_dir": str(model_dir), "hybrid": hybrid, "prompt": prompt}
        cold = serve_prompt(None, {**job, "seq_id": 1})
        a = serve_prompt(ctx.store, {**job, "seq_id": 2})
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, __file__, "--engine"],
            input=json.dumps({**job, "seq_id": 3, "master": ctx.cluster.master_address}),
            capture_output=True,
            text=True,
            timeout=45,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        b = json.loads(proc.stdout)
    return {
        "prompt_tokens": len(prompt),
        "cold": cold,
        "a": a,
        "b": b,
        "b_process_s": round(time.monotonic() - t0, 3),
    }


def serve_prompt(store: Any, job: Info) -> Info:
    """Serve ``job["prompt"]`` (greedy) on one engine with a torch executor on the tiny model
    in ``job["model_dir"]``, with external KV through ``store`` unless it is None; then drain
    and check that nothing leaks. Returns the tokens and what the engine did."""
    import torch
    from tests.replay.external_helpers import Node, config

    from kvsched.config import ModelSpec
    from kvsched.events import types as ev
    from kvsched.gpu.model import HybridConfig
    from kvsched.gpu.torch_executor import TorchExecutor
    from kvsched.gpu.transfer_buffer import TorchCacheBuffer

    torch.set_num_threads(1)  # tiny tensors: one thread is the fastest on a small machine
    hybrid = job["hybrid"]
    # the two tiny models differ: distinct names keep their KV apart in the shared store
    name = "kvsched-test-tiny-hybrid" if hybrid else "kvsched-test-tiny-attention"
    vocab = HybridConfig.from_pretrained(job["model_dir"]).vocab_size
    cfg = config(
        model=ModelSpec(name=name, vocab_size=vocab, max_context=512),
        hybrid=hybrid,
        external_kv=store is not None,
    )
    executor = TorchExecutor(
        job["model_dir"],
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size,
        num_state_slots=cfg.num_state_slots,
        device="cpu",
    )
    node = Node(store, cfg, executor=executor, buffers=TorchCacheBuffer(executor))
    seq_id = job["seq_id"]
    prompt = np.asarray(job["prompt"], dtype=np.int32)
    node.run([ev.RequestArrived(seq_id, prompt, max_tokens=ENGINE_MAX_TOKENS)])
    loads = node.of_type(ev.KVLoadStarted)
    info = {
        "tokens": node.outputs[seq_id],
        "prefill_tokens": node.prefill_tokens,
        "loads": len(loads),
        "state_loads": sum(d.state_slot >= 0 for d in loads),
        "load_failures": [e.reason for e in node.inputs if isinstance(e, ev.KVLoadFailed)],
        "saves": len(node.of_type(ev.KVSaveStarted)),
        "saves_failed": sum(not e.ok for e in node.inputs if isinstance(e, ev.KVSaveFinished)),
        "external_hit_tokens": node.engine.state.stats.external_hit_tokens,
    }
    node.assert_nothing_leaks()
    return info


def engine_main() -> None:
    """Engine B: serve the job on stdin with its own Mooncake client; print the report."""
    from kvsched.connectors.mooncake_store import MooncakeStore

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Mooncake writes to fd 1: keep it off the report
    job = json.loads(sys.stdin.read())
    store = MooncakeStore(job["master"])
    try:
        info = serve_prompt(store, job)
    finally:
        store.close()
    out.write(json.dumps(info))
    out.close()


# ------------------------------------------------------------- engine-level store faults

FAULT_PROMPT_TOKENS = 300  # 18 full 16-token blocks (the load) and a 12-token suffix
FAULT_GATE_AT_READ = 2  # the load's 1st read (16 blocks) passes; the store dies before its 2nd


class GatedReads:
    """Engine B's view of its store: the load's ``gate_at``-th ``get_many`` (one
    TransferEngine batch) stops, says so on ``reached`` and waits for ``release``, so the test
    kills the store while the load is in flight: deterministically mid-load, where an ungated
    load of 18 tiny blocks over loopback ends in milliseconds. Everything else passes."""

    def __init__(self, inner: Any, gate_at: int) -> None:
        self.inner = inner
        self.gate_at = gate_at
        self.reads = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    def get_many(self, keys: Any) -> list[bytes | None]:
        self.reads += 1
        if self.reads == self.gate_at:
            self.reached.set()
            self.release.wait(timeout=20)
        result: list[bytes | None] = self.inner.get_many(keys)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def engine_load_survives_store_killed(ctx: Context) -> Info:
    """The whole store (memory holder, then master) is SIGKILLed during engine B's load."""
    return _engine_load_store_killed(kill_master=True)


def engine_load_survives_holder_killed(ctx: Context) -> Info:
    """Only the memory holder is SIGKILLed during engine B's load; the master lives on."""
    return _engine_load_store_killed(kill_master=False)


def _engine_load_store_killed(kill_master: bool) -> Info:
    """Engine A saves prompt P to a private Mooncake cluster (FingerprintExecutor, attention
    only); engine B (own client, ``synchronous=False``) serves P, its lookup hits 18 blocks and
    it starts the load; the load's first batch (16 blocks) is read, then, before its second
    batch, the store is killed (see ``GatedReads``). B must get ``KVLoadFailed`` within a
    bounded time, keep the 16 good blocks, compute the rest and produce a cold run's tokens,
    and hold nothing after a drain."""
    from tests.replay.external_helpers import Node, config, prompt

    from kvsched.connectors.mooncake_store import MooncakeStore
    from kvsched.events import types as ev
    from kvsched.statemachines import SeqState

    p = prompt(FAULT_PROMPT_TOKENS, seed=91)
    cold = Node(None, config())
    cold.run([ev.RequestArrived(1, p, ENGINE_MAX_TOKENS)])
    assert cold.prefill_tokens == len(p) and cold.executor.mismatches == []
    # a private cluster: the shared one (the fixture's, one per session) must survive
    with MooncakeCluster.start(client_ttl_s=2) as cluster:
        store_a = MooncakeStore(cluster.master_address, timeout_s=2.0)
        store_b = MooncakeStore(cluster.master_address, timeout_s=2.0)
        gated = GatedReads(store_b, FAULT_GATE_AT_READ)
        try:
            a = Node(store_a, config(external_kv=True))
            a.run([ev.RequestArrived(2, p, ENGINE_MAX_TOKENS)])
            assert a.of_type(ev.KVSaveStarted), "engine A saved nothing"
            assert all(e.ok for e in a.inputs if isinstance(e, ev.KVSaveFinished)), a.inputs
            assert a.outputs[2] == cold.outputs[1]
            a.assert_nothing_leaks()

            b = Node(gated, config(external_kv=True), synchronous=False, job_timeout_s=5.0)
            seq = 3
            b.step([ev.RequestArrived(seq, p, ENGINE_MAX_TOKENS)])
            assert b.of_type(ev.KVLookupStarted), b.decisions
            for _ in range(5):  # the lookup is answered at once; its answer starts the load
                if b.of_type(ev.KVLoadStarted):
                    break
                b.step()
            (load,) = b.of_type(ev.KVLoadStarted)
            t_load_started = time.monotonic()
            assert b.engine.state.seq(seq).state == SeqState.LOADING_KV
            assert len(load.blocks) == (len(p) - 1) // 16, load
            assert gated.reached.wait(timeout=10), "the load never reached its second read"
            t_gate = time.monotonic()  # the first 16 blocks are read and written by now
            assert b.engine.state.seq(seq).state == SeqState.LOADING_KV  # still in flight
            t_kill = time.monotonic()
            cluster.kill_holder()
            if kill_master:
                cluster.kill_master()
            gated.release.set()
            failed: list[ev.KVLoadFailed] = []
            deadline = t_kill + 15.0
            while not failed:
                assert time.monotonic() < deadline, "the load neither failed nor finished"
                assert not any(isinstance(e, ev.KVLoadFinished) for e in b.inputs), b.inputs
                if not b.pending:
                    time.sleep(0.001)
                b.step()
                failed = [e for e in b.inputs if isinstance(e, ev.KVLoadFailed)]
            t_failed = time.monotonic()
            b.run()
            (failure,) = failed
            info: Info = {
                "prompt_tokens": len(p),
                "killed": "holder+master" if kill_master else "holder",
                "load_blocks": len(load.blocks),
                "good_blocks": failure.num_good_blocks,
                "reason": failure.reason,
                "kill_to_failure_s": round(t_failed - t_kill, 3),
                "load_start_to_failure_s": round(t_failed - t_load_started, 3),
                "first_batch_s": round(t_gate - t_load_started, 4),
                "b_prefill_tokens": b.prefill_tokens,
                "b_loads": len(b.of_type(ev.KVLoadStarted)),
                "b_saves": len(b.of_type(ev.KVSaveStarted)),
                "b_saves_failed": sum(
                    not e.ok for e in b.inputs if isinstance(e, ev.KVSaveFinished)
                ),
                "b_tokens_equal_cold": b.outputs[seq] == cold.outputs[1],
                "b_mismatches": len(b.executor.mismatches),
            }
            assert t_failed - t_kill < 10.0, info
            assert failure.seq_id == seq and failure.num_good_blocks == 16, info
            assert b.outputs[seq] == cold.outputs[1], (b.outputs[seq], cold.outputs[1])
            assert b.executor.mismatches == [], b.executor.mismatches
            # attention keeps the 16 good blocks and computes only the rest of the prompt
            assert b.prefill_tokens == len(p) - 16 * 16, info
            transfers = b.engine.state.transfers
            assert transfers.loaded_blocks == 16 and transfers.failed_loads == 1, info
            t0 = time.monotonic()
            b.assert_nothing_leaks()
            info["b_drain_s"] = round(time.monotonic() - t0, 3)
            info["tokens"] = b.outputs[seq]
            return info
        finally:
            gated.release.set()  # never leave the load's thread parked on the gate
            store_b.close()  # each close is bounded by the client's timeout_s
            store_a.close()


SCENARIOS: dict[str, Callable[[Context], Info]] = {
    f.__name__: f
    for f in (
        round_trip,
        lookup_leading,
        missing_and_failing_blocks,
        holder_killed_during_load,
        master_killed_during_load,
        master_frozen_during_load,
        two_processes_share_blocks,
        engines_share_prefix_attention,
        engines_share_prefix_hybrid,
        engine_load_survives_store_killed,
        engine_load_survives_holder_killed,
    )
}


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # Mooncake writes to fd 1 and 2: keep both off the protocol channel

    def reply(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")

    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        reply({"skip": f"mooncake.store cannot be imported here: {exc}"})
        return
    try:
        ctx = Context()
    except Exception as exc:
        reply({"skip": f"cannot start a Mooncake master and memory holder: {exc}"[:2000]})
        return
    reply({"ready": True})
    try:
        for line in sys.stdin:
            name = json.loads(line)["scenario"]
            if name == "__exit__":
                break
            t0 = time.monotonic()
            try:
                info = SCENARIOS[name](ctx)
                reply({"ok": True, "info": info, "s": round(time.monotonic() - t0, 3)})
            except BaseException:
                reply({"ok": False, "error": traceback.format_exc()})
    finally:
        ctx.close()
        reply({"bye": True})


if __name__ == "__main__":
    if sys.argv[1:] == ["--reader"]:
        reader_main()
    elif sys.argv[1:] == ["--engine"]:
        engine_main()
    else:
        main()
