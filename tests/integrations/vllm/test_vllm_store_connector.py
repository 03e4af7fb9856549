"""kvsched's store path as a vLLM KV connector (``KvschedConnector``), hybrid states included,
and prefill/decode disaggregation over it (``integrations/vllm/store_connector.py``,
``store_bridge.py``, ``disagg.py``).

End to end on vLLM's CPU build: a first engine saves to a directory store, a fresh engine in
another process loads from it. Greedy outputs equal vLLM's own scheduler's without a store,
request by request; the external hits are kvsched loads in the fresh engine's log (a hybrid
model's with its state), reported as ``num_cached_tokens`` and in vLLM's prompt-token
metrics by source; both logs verify."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

from kvsched.events import types as ev
from kvsched.events.codec import decode_record
from kvsched.events.reader import read_log
from kvsched.integrations.vllm.models import build

from .test_vllm_scheduler import PRELUDE, _script_result, _verifies

SCRIPT = """
import json, sys
import numpy as np
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from kvsched.integrations.vllm.disagg import engine_args
from kvsched.integrations.vllm.run import kvsched_scheduler
o = json.loads(sys.argv[1])  # model, scheduler, store, phase, kind, connector options
hybrid = o["kind"] == "hybrid"
kw = engine_args(o["model"], "both", str(o["store"]), hybrid)
kw["async_scheduling"] = OVERLAP  # (test_vllm_scheduler.PRELUDE)
if o["scheduler"] == "vllm":
    del kw["scheduler_cls"]
else:
    kw["additional_config"] = {"kvsched": {"check_invariants": True}}
if o["store"] is None:
    del kw["kv_transfer_config"]
else:
    kw["kv_transfer_config"]["kv_connector_extra_config"].update(o.get("options", {}))
    kw["kv_transfer_config"]["kv_load_failure_policy"] = o.get("policy", "recompute")
llm = LLM(disable_log_stats=False, **kw)
rng = np.random.default_rng(0)
prefix = rng.integers(10, 400, 1300 if hybrid else 300).tolist()
prompts = [prefix + rng.integers(10, 400, 20 + 7 * i).tolist() for i in range(3)]
prompts.append(rng.integers(10, 400, 150).tolist())
# the first engine computes and saves prompts 0 and 1; the fresh one serves all four
todo = prompts[:2] if o["phase"] == "save" else prompts
greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False)
out = []
kill = o.get("kill")  # {"after": n, "pid": p}: SIGKILL p after n requests (a store process)
for i, p in enumerate(todo):  # (one at a time: each sees what the previous one left)
    if kill and i == kill["after"]:
        import os, signal
        os.kill(kill["pid"], signal.SIGKILL)
    r = llm.generate([TokensPrompt(prompt_token_ids=p)], greedy, use_tqdm=False)[0]
    out.append([list(r.outputs[0].token_ids), r.num_cached_tokens, r.outputs[0].finish_reason])
by_source = {m.labels.get("source"): m.value for m in llm.get_metrics()
             if m.name == "vllm:prompt_tokens_by_source"}
left = None
sched = kvsched_scheduler(llm)
if sched is not None:  # (kvsched's folds and transfers still owed: stepped to the end)
    while sched.has_requests():
        llm.llm_engine.step()
    loads, saves = sched.engine.transfers_in_flight()
    usage = sched.get_kv_cache_usage() if not hybrid else 0.0  # (hybrid: checkpoints pin KV)
    left = {"usage": usage, "loads": loads, "saves": saves}
core = llm.llm_engine.engine_core.engine_core
engine = {"async": OVERLAP, "queue": core.batch_queue_size}
print("RESULT" + json.dumps({"requests": out, "by_source": by_source, "left": left,
                             "engine": engine}))
"""


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3", tmp_path_factory.mktemp("qwen3") / "model")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3-next", tmp_path_factory.mktemp("qwen3next") / "model")


def _run(
    model: Path,
    scheduler: str,
    store: Path | None,
    phase: str,
    kind: str,
    log: Path | None = None,
    policy: str = "recompute",
    overlap: bool = False,
    **options: Any,
) -> Any:
    """One engine's run of the script (``overlap``: under vLLM's async scheduling): its
    requests, vLLM's prompt-token counts by source, how the engine ran, and (kvsched) what
    it holds once stepped to the end (cache usage, loads and saves)."""
    import json

    env = {"KVSCHED_VLLM_LOG": str(log)} if log is not None else None
    if phase == "load":
        options.setdefault("synchronous", True)
    where = None if store is None else f"dir:{store}"
    run = {"model": str(model), "scheduler": scheduler, "store": where, "phase": phase}
    run.update(kind=kind, options=options, policy=policy)
    got = _script_result(SCRIPT, json.dumps(run), env=env, overlap=overlap)
    if got["left"] is not None:  # (no block, load or save left behind)
        assert got["left"] == {"usage": 0.0, "loads": [], "saves": []}
    return got


def _decisions(log: Path) -> list[ev.Event]:
    return [d for r in read_log(log).records for d in decode_record(r).decisions]


def _inputs(log: Path) -> list[ev.Event]:
    return [e for r in read_log(log).records for e in decode_record(r).inputs]


@pytest.fixture(scope="module")
def attention_saved(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """vLLM's own scheduler without a store (the reference), and a kvsched engine with
    ``KvschedConnector`` that saved prompts 0 and 1: (reference, store, the save's log)."""
    return _saved(qwen3, "attention", tmp_path_factory.mktemp("attention"))


@pytest.fixture(scope="module")
def hybrid_saved(qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return _saved(qwen3_next, "hybrid", tmp_path_factory.mktemp("hybrid"))


def _saved(model: Path, kind: str, where: Path) -> tuple[Any, Path, Path]:
    ref = _run(model, "vllm", None, "load", kind)
    log = where / "save.kvlog"
    save = _run(model, "kvsched", where / "store", "save", kind, log)
    assert [r[0] for r in save["requests"]] == [r[0] for r in ref["requests"][:2]]
    _verifies(log)
    return ref, where / "store", log


def _load(
    model: Path,
    saved: tuple,
    tmp_path: Path,
    failed: tuple[int, ...] = (),
    overlap: bool = False,
    **options: Any,
) -> tuple[Any, Path]:
    """A fresh engine serving all four prompts from a copy of the saved store: its tokens
    equal the reference's (whatever the store does; the requests ``failed`` end in error,
    under vLLM's ``kv_load_failure_policy`` "fail") and its log verifies."""
    import shutil

    ref, store, _ = saved
    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    log = tmp_path / "load.kvlog"
    kind = "hybrid" if "next" in model.parent.name else "attention"
    policy = "fail" if failed else "recompute"
    got = _run(model, "kvsched", mine, "load", kind, log, policy, overlap, **options)
    for i, (mine_i, ref_i) in enumerate(zip(got["requests"], ref["requests"], strict=True)):
        if i in failed:
            assert mine_i[0] == [] and mine_i[2] == "error", mine_i
        else:
            assert mine_i[0] == ref_i[0], i
    _verifies(log)
    return got, log


def test_vllm_kvsched_connector_loads_a_fresh_engine_token_identical_to_vllm(
    qwen3: Path, attention_saved: tuple, tmp_path: Path
):
    """Attention model, 32-token blocks: the fresh engine loads the stored prompts' blocks
    (not their last token: 288 of 320, 320 of 327 tokens), hits prompt 0's loaded prefix
    locally for prompt 2 and computes the unrelated prompt 3; vLLM's metrics count the
    loaded tokens as external, the rest of the hits as local."""
    ref, _, save_log = attention_saved
    load, log = _load(qwen3, attention_saved, tmp_path)
    assert [r[1] for r in ref["requests"]] == [0, 288, 288, 0]  # (vLLM, no store)
    assert [r[1] for r in load["requests"]] == [288, 320, 288, 0]
    assert load["by_source"]["external_kv_transfer"] == 288 + 32
    assert load["by_source"]["local_cache_hit"] == 288 + 288
    settled = [d for d in _decisions(log) if isinstance(d, ev.KVLoadSettled)]
    assert [d.num_blocks for d in settled] == [9, 10]
    saves = [d for d in _decisions(save_log) if isinstance(d, ev.KVSaveStarted)]
    # prompt 0's ten full blocks, then prompt 1's tenth (it shares nine with prompt 0)
    assert sum(len(d.blocks) for d in saves) == 11


def test_vllm_kvsched_connector_restores_a_hybrid_prefix_with_its_state_from_the_store(
    qwen3_next: Path, hybrid_saved: tuple, tmp_path: Path
):
    """Tiny Qwen3-Next (640-token blocks): the first engine saves prompt 0's two blocks with
    the state at their end; the fresh engine's first request loads both blocks and the
    state (1,280 tokens, where vLLM alone has no hit) and its outputs equal a run that
    computed everything."""
    ref, _, save_log = hybrid_saved
    load, log = _load(qwen3_next, hybrid_saved, tmp_path)
    assert [r[1] for r in ref["requests"]] == [0, 1280, 1280, 0]
    assert [r[1] for r in load["requests"]] == [1280, 1280, 1280, 0]
    assert load["by_source"]["external_kv_transfer"] >= 1280
    saves = [d for d in _decisions(save_log) if isinstance(d, ev.KVSaveStarted)]
    assert saves and all(d.ckpt_id >= 0 and d.state_slot > 0 for d in saves)
    loads = [d for d in _decisions(log) if isinstance(d, ev.KVLoadStarted)]
    first = loads[0]
    assert len(first.blocks) == 2 and first.state_slot > 0 and first.state_hash
    settled = [d for d in _decisions(log) if isinstance(d, ev.KVLoadSettled)]
    assert settled[0].num_blocks == 2 and settled[0].state_slot == first.state_slot


def _stored(store: Path) -> list[str]:
    return sorted(str(f.relative_to(store)) for f in store.rglob("*") if f.is_file())


@pytest.mark.parametrize("loads", ["synchronous", "asynchronous"])
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_vllm_kvsched_connector_under_async_scheduling_saves_and_loads_as_in_the_synchronous_order(
    kind: str, loads: str, request: pytest.FixtureRequest, tmp_path: Path
):
    """vLLM's asynchronous engine loop (step N+1 scheduled before step N's output is
    processed; ``cpu_async`` keeps it on for vLLM's CPU build): an engine saves the same
    keys as the synchronous engine did, and a fresh one, with synchronous or asynchronous
    loads, serves the reference's tokens with the synchronous load's hits (a hybrid
    model's state restored from the store); no block, load or save is left behind; both
    logs verify."""
    model = request.getfixturevalue("qwen3" if kind == "attention" else "qwen3_next")
    ref, sync_store, _ = request.getfixturevalue(f"{kind}_saved")
    store, logs = tmp_path / "store", [tmp_path / "save.kvlog", tmp_path / "load.kvlog"]
    save = _run(model, "kvsched", store, "save", kind, logs[0], overlap=True)
    assert save["engine"] == {"async": True, "queue": 2}  # (vLLM's asynchronous loop)
    assert [r[0] for r in save["requests"]] == [r[0] for r in ref["requests"][:2]]
    assert _stored(store) == _stored(sync_store)
    sync = loads == "synchronous"
    load = _run(model, "kvsched", store, "load", kind, logs[1], overlap=True, synchronous=sync)
    assert [r[0] for r in load["requests"]] == [r[0] for r in ref["requests"]]
    hits = [288, 320, 288, 0] if kind == "attention" else [1280, 1280, 1280, 0]
    assert [r[1] for r in load["requests"]] == hits
    assert load["by_source"]["external_kv_transfer"] >= hits[0]
    for log in logs:
        _verifies(log)


# --------------------------------------------------------------------------- faults

# A load's faults (``connectors/drills.py``: the worker's store fails on cue, after the
# scheduler's lookup found the blocks): the first request's load of nine blocks.
LOAD_FAULTS = {
    # the store killed after three blocks were read: those three are kept
    "killed": ({"mode": "kill", "after": 3}, 3),
    # frozen after two: the load ends at its deadline (1 s) with none written (the batch
    # read in flight holds the two values read, as a hung store's client call does)
    "frozen": ({"mode": "freeze", "after": 2, "freeze_s": 4.0}, 0),
    # the fifth key evicted between the lookup and the load: a partial load of four
    "evicted": ({"mode": "evict", "after": 4}, 4),
}


@pytest.mark.parametrize("order", ["sync", "async"])
@pytest.mark.parametrize("fault", sorted(LOAD_FAULTS))
def test_vllm_kvsched_connector_load_fault_keeps_the_good_blocks_and_recomputes_the_rest(
    fault: str, order: str, qwen3: Path, attention_saved: tuple, tmp_path: Path
):
    """The store killed, frozen, or missing a key during a load: vLLM keeps serving, every
    request's tokens equal a run without the store, the first request keeps exactly the
    blocks written before the fault, no block, load or save is left behind, and the log
    verifies (kvsched's invariants checked after every step); in vLLM's synchronous loop
    and under its async scheduling."""
    drill, good = LOAD_FAULTS[fault]
    options = {"drill": drill, "job_timeout_s": 1.0}
    got, log = _load(qwen3, attention_saved, tmp_path, overlap=order == "async", **options)
    failed = [e for e in _inputs(log) if isinstance(e, ev.KVLoadFailed)]
    assert failed and failed[0].num_good_blocks == good, failed
    assert got["requests"][0][1] == good * 32


def test_vllm_kvsched_connector_load_fault_under_vllms_fail_policy_ends_that_request_in_error(
    qwen3: Path, attention_saved: tuple, tmp_path: Path
):
    """vLLM's default ``kv_load_failure_policy`` "fail": the requests whose load failed
    end with an error and no token (the store is killed in the first one's load: the three
    sharing the stored prefix each try a load), the unrelated one is served."""
    drill = {"mode": "kill", "after": 3}
    _, log = _load(qwen3, attention_saved, tmp_path, failed=(0, 1, 2), drill=drill)
    aborted = [e for e in _inputs(log) if isinstance(e, ev.RequestAborted)]
    assert any("KV load failed" in e.reason for e in aborted), aborted


def test_vllm_kvsched_connector_hybrid_load_missing_a_key_restores_no_state_and_recomputes(
    qwen3_next: Path, hybrid_saved: tuple, tmp_path: Path
):
    """A hybrid load whose second block is evicted before it is read: no state is restored
    past the local prefix (a state needs all the blocks before it), the request recomputes
    and its tokens equal a run without the store."""
    got, log = _load(qwen3_next, hybrid_saved, tmp_path, drill={"mode": "evict", "after": 1})
    failed = [e for e in _inputs(log) if isinstance(e, ev.KVLoadFailed)]
    assert failed and failed[0].num_good_blocks == 1
    assert got["requests"][0][1] == 0
    decisions = _decisions(log)
    assert not any(isinstance(d, ev.KVLoadSettled) and d.num_blocks for d in decisions)
    preempted = [d for d in decisions if isinstance(d, ev.SequencePreempted)]
    assert preempted and preempted[0].seq_id == failed[0].seq_id


@pytest.mark.parametrize("mode", ["kill", "freeze"])
def test_vllm_kvsched_connector_save_fault_releases_its_lease_and_stores_nothing_wrong(
    mode: str, qwen3: Path, attention_saved: tuple, tmp_path: Path
):
    """The store killed or frozen while saving: every save ends failed (a frozen one at its
    1 s deadline), its lease is released, the tokens equal a run without the store; a fresh
    engine on what was stored loads nothing it should not (tokens still equal)."""
    ref = attention_saved[0]
    store, log = tmp_path / "store", tmp_path / "save.kvlog"
    drill = {"mode": mode, "on": "put", "freeze_s": 4.0}
    got = _run(qwen3, "kvsched", store, "save", "attention", log, drill=drill, job_timeout_s=1.0)
    assert [r[0] for r in got["requests"]] == [r[0] for r in ref["requests"][:2]]
    _verifies(log)
    ended = [e for e in _inputs(log) if isinstance(e, ev.KVSaveFinished)]
    started = [d for d in _decisions(log) if isinstance(d, ev.KVSaveStarted)]
    assert started and len(ended) == len(started) and not any(e.ok for e in ended)
    _load(qwen3, (ref, store, log), tmp_path / "fresh")


# --------------------------------------------------------------------------- Mooncake Store

MOONCAKE = """
import json, os, subprocess, sys
from kvsched.connectors.mooncake_cluster import MooncakeCluster
script, run, logs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {}
with MooncakeCluster.start() as cluster:  # (inside a private network namespace)
    for phase, log in zip(("save", "load"), logs):
        mine = dict(run, phase=phase, store="mooncake:" + cluster.master_address)
        if phase == "load":  # the master killed after two requests (their loads landed)
            mine["kill"] = {"after": 2, "pid": cluster.master.pid}
        env = dict(os.environ, KVSCHED_VLLM_LOG=log)
        p = subprocess.run([sys.executable, "-c", script, json.dumps(mine)], env=env,
                           capture_output=True, text=True, timeout=400)
        if p.returncode:
            print("FAILED " + phase + p.stderr[-4000:])
            sys.exit(1)
        line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT"))
        out[phase] = json.loads(line[len("RESULT"):])
print("RESULT" + json.dumps(out))
"""


def _mooncake_unavailable() -> str | None:
    import importlib.util
    import shutil
    import subprocess
    import sys

    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine-non-cuda is not installed in this environment"
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True)
    if probe.returncode:
        return f"mooncake.store does not import: {probe.stderr.decode()[-300:]}"
    if not (shutil.which("unshare") and shutil.which("ip")):
        return "unshare / ip missing: no private network namespace for Mooncake"
    ns = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True)
    return f"unshare -rn is not permitted: {ns.stderr.strip()}" if ns.returncode else None


def test_vllm_kvsched_connector_on_mooncake_store_serves_a_fresh_engine_and_outlives_the_master(
    qwen3: Path, attention_saved: tuple, tmp_path: Path
):
    """A real Mooncake Store on loopback (master and holder in a private network
    namespace): a first engine saves, a fresh one loads (288, 320 tokens, as from the
    directory store); then the master is killed: the next requests' lookups and saves fail,
    they are computed, the tokens equal a run without a store, nothing is left held, and
    both logs verify."""
    import json
    import os
    import subprocess
    import sys

    why = _mooncake_unavailable()
    if why is not None:
        pytest.skip(why)
    ref = attention_saved[0]
    logs = [str(tmp_path / "save.kvlog"), str(tmp_path / "load.kvlog")]
    run = {"model": str(qwen3), "scheduler": "kvsched", "kind": "attention"}
    run["options"] = {"lookup_timeout_s": 2.0, "job_timeout_s": 3.0}
    run["policy"] = "recompute"
    shell = 'ip link set lo up && exec "$0" -c "$1" "$2" "$3" "$4"'
    cmd = ["unshare", "-rn", "sh", "-c", shell, sys.executable, MOONCAKE, PRELUDE + SCRIPT]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    proc = subprocess.run(
        [*cmd, json.dumps(run), json.dumps(logs)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    got = json.loads(line[len("RESULT") :])
    assert [r[0] for r in got["save"]["requests"]] == [r[0] for r in ref["requests"][:2]]
    assert [r[0] for r in got["load"]["requests"]] == [r[0] for r in ref["requests"]]
    assert [r[1] for r in got["load"]["requests"][:2]] == [288, 320]
    for phase in ("save", "load"):
        assert got[phase]["left"] == {"usage": 0.0, "loads": [], "saves": []}
    for log in logs:
        _verifies(Path(log))
    answers = [e for e in _inputs(Path(logs[1])) if isinstance(e, ev.KVLookupAnswered)]
    assert [e.num_blocks for e in answers][:2] == [9, 10]
    ended = [e for e in _inputs(Path(logs[1])) if isinstance(e, ev.KVSaveFinished)]
    assert ended and not ended[-1].ok  # (the last saves met the dead master)


# --------------------------------------------------------------------------- disaggregation


def _disaggregated(
    model: Path, hybrid: bool, tmp_path: Path, overlap: bool = False
) -> tuple[list, list, list[Path]]:
    import os

    from kvsched.integrations.vllm.disagg import Proxy

    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    import numpy as np

    rng = np.random.default_rng(3)
    shared = rng.integers(10, 400, 900 if hybrid else 200).tolist()
    lengths = (60, 130, 410) if hybrid else (10, 45, 77)
    prompts = [shared + rng.integers(10, 400, n).tolist() for n in lengths]
    prompts.append(rng.integers(10, 400, 500 if hybrid else 90).tolist())
    logs = [tmp_path / "prefill.kvlog", tmp_path / "decode.kvlog"]
    store = f"dir:{tmp_path / 'store'}"
    proxy = Proxy(str(model), store, hybrid, (str(logs[0]), str(logs[1])), overlap)
    assert [r["batch_queue_size"] for r in proxy.ready] == [2 if overlap else 1] * 2
    try:
        got = proxy.generate(prompts, max_tokens=8)
    finally:
        ends = proxy.close()
    nothing = {"loads": [], "saves": []}  # (every save reported, its lease released)
    assert ends == ({"exit": 0, "left": nothing}, {"exit": 0, "left": nothing})
    return prompts, got, logs


def _single_engine(model: Path, prompts: list, hybrid: bool) -> list:
    script = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from kvsched.integrations.vllm.disagg import engine_args
kw = engine_args(sys.argv[1], "both", "dir:/nonexistent", sys.argv[2] == "hybrid")
del kw["scheduler_cls"], kw["kv_transfer_config"]
llm = LLM(**kw)
greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False)
prompts = json.loads(sys.argv[3])
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
print("RESULT" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
    import json

    kind = "hybrid" if hybrid else "attention"
    return list(_script_result(script, str(model), kind, json.dumps(prompts)))


@pytest.mark.parametrize("order", ["sync", "async"])
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_vllm_disaggregated_prefill_and_decode_equal_one_engine_and_decode_loads_the_prefill(
    kind: str, order: str, qwen3: Path, qwen3_next: Path, tmp_path: Path
):
    """A prefill engine (kv_producer) and a decode engine (kv_consumer) under kvsched, the
    store between them and ``disagg.Proxy`` routing each request: the tokens equal one
    engine's under vLLM's own scheduler, and the decode engine's hit covers every prompt
    block the prefill engine computed (it computes only the tail); it saves nothing. Both
    engines in vLLM's synchronous loop, or both under its async scheduling."""
    hybrid = kind == "hybrid"
    model = qwen3_next if hybrid else qwen3
    prompts, got, logs = _disaggregated(model, hybrid, tmp_path, order == "async")
    want = _single_engine(model, prompts, hybrid)
    assert [g["tokens"] for g in got] == want
    for g, prompt in zip(got, prompts, strict=True):
        assert g["prefill"]["tokens"] == g["tokens"][:1]
        blocks = g["prefill"]["kv_transfer_params"]["kvsched"]["prompt_blocks"]
        bs = 640 if hybrid else 32  # (models.STATE_DTYPE pinned: the same on every CPU)
        assert blocks == len(prompt) // bs
        assert g["num_cached_tokens"] == min(blocks, (len(prompt) - 1) // bs) * bs, g["id"]
    for log in logs:
        _verifies(log)
    assert not any(isinstance(d, ev.KVSaveStarted) for d in _decisions(logs[1]))


@pytest.mark.parametrize(
    "scheduler_cls, tp, message",
    [
        (None, 1, "runs under kvsched's scheduler only .* --scheduler-cls"),
        ("vllm.v1.core.sched.async_scheduler.AsyncScheduler", 1, "kvsched's scheduler only"),
        ("kvsched.integrations.vllm.Scheduler", 2, "one worker"),
    ],
)
def test_vllm_kvsched_connector_refuses_vllms_own_scheduler_and_tensor_parallelism(
    scheduler_cls, tp, message
):
    """kvsched's policy decides ``KvschedConnector``'s transfers: under vLLM's own scheduler
    (which would call ``get_num_new_matched_tokens``) it refuses to start, with the flag."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvsched.integrations.vllm.store_connector import KvschedConnector, StoreOptionsError

    vc = NS(
        kv_transfer_config=NS(kv_connector_extra_config={"store": "dir:/nonexistent"}),
        scheduler_config=NS(scheduler_cls=scheduler_cls),
        parallel_config=NS(world_size=tp),
    )
    with pytest.raises(StoreOptionsError, match=message):
        KvschedConnector(vc, KVConnectorRole.SCHEDULER, None)


def _store_bridge(tmp_path, wait_s: float):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvsched.integrations.vllm.store_bridge import StoreBridge
    from kvsched.integrations.vllm.store_connector import KvschedConnector

    extra = {"store": f"dir:{tmp_path}", "wait_prefilled_s": wait_s}
    vc = NS(
        kv_transfer_config=NS(kv_connector_extra_config=extra),
        scheduler_config=NS(scheduler_cls="kvsched.integrations.vllm.Scheduler"),
        parallel_config=NS(world_size=1),
    )
    return StoreBridge(KvschedConnector(vc, KVConnectorRole.SCHEDULER, None), None, 16)


@pytest.mark.parametrize("wait_s", [30.0, 0.0])
def test_vllm_store_bridge_holds_a_prefilled_requests_lookup_until_its_prompt_blocks_are_stored(
    tmp_path, wait_s: float
):
    """A request another engine prefilled (``kv_transfer_params``) is answered only once
    the store holds the prompt blocks the prefill computed, or when its wait is over (0 s:
    at once, with what is there); a request without them is answered at once."""
    from kvsched.connectors.directory_store import DirectoryStore
    from kvsched.connectors.keys import block_key
    from kvsched.events import types as ev

    bridge = _store_bridge(tmp_path, wait_s)
    root, hashes = bytes(16), [bytes([i + 1]) * 16 for i in range(4)]
    prefilled = NS(kv_transfer_params={"kvsched": {"prompt_blocks": 4}})
    plain = NS(kv_transfer_params=None)
    req_of = {1: prefilled, 2: plain}
    asked = [ev.KVLookupStarted(s, 0, 4, root, b"".join(hashes)) for s in (1, 2)]
    bridge.after_step(asked, req_of, None)
    store = DirectoryStore(tmp_path)
    store.put_many([(block_key(root, h), b"kv") for h in hashes[:2]])
    first = bridge.inputs(req_of)
    if wait_s == 0.0:
        assert first == [ev.KVLookupAnswered(1, 0), ev.KVLookupAnswered(2, 0)]
        return
    assert first == [ev.KVLookupAnswered(2, 0)]  # (probed when asked: nothing stored yet)
    assert bridge.inputs(req_of) == []  # two of four stored: still waiting
    store.put_many([(block_key(root, h), b"kv") for h in hashes[2:]])
    assert bridge.inputs(req_of) == [ev.KVLookupAnswered(1, 4)]
    assert bridge.inputs(req_of) == []
