"""vLLM's KV connectors under kvsched: the connector's scheduler side driven on kvsched's
external-KV machine (``integrations/vllm/connector.py``).

End to end with ``ExampleConnector``, the connector vLLM's CPU build runs (its worker side
saves each new prompt's KV to files and loads a whole stored prompt): a first engine saves,
a fresh engine loads. Greedy outputs and cached tokens equal vLLM's own scheduler's request
by request, the loads are in kvsched's log as ``KVLoad`` machines, and both logs verify.
The asynchronous protocol (no connector that loads asynchronously runs on vLLM's CPU build:
OffloadingConnector, SimpleCPUOffloadConnector and MooncakeStoreConnector need CUDA) is
checked at the bridge, against a scripted connector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

from kvsched.engine import LookupAnswer
from kvsched.events import types as ev
from kvsched.events.codec import decode_record
from kvsched.events.reader import read_log
from kvsched.integrations.vllm import harness as h
from kvsched.integrations.vllm.connector import ConnectorBridge, ConnectorError
from kvsched.integrations.vllm.harness_connector import HarnessConnector

from .test_vllm_harness import assert_same_outputs
from .test_vllm_scheduler import _script_result, _verifies

EXAMPLE = """
import json, sys
import numpy as np
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, scheduler, store, phase = sys.argv[1:5]
kw = {} if scheduler == "vllm" else {"scheduler_cls": "kvsched.integrations.vllm.Scheduler"}
llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=2048, dtype="float32",
          max_num_batched_tokens=2048, max_num_seqs=8, seed=0, skip_tokenizer_init=True,
          enable_prefix_caching=True, async_scheduling=OVERLAP,
          kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": store}},
          **kw)
rng = np.random.default_rng(0)
prefix = rng.integers(10, 400, 300).tolist()
prompts = [prefix + rng.integers(10, 400, 20 + 7 * i).tolist() for i in range(3)]
prompts.append(rng.integers(10, 400, 150).tolist())
# the first engine computes and saves prompts 0 and 1; the fresh one loads them (whole
# stored prompts), hits prompt 0's loaded prefix locally for prompt 2, computes prompt 3
todo = prompts[:2] if phase == "save" else prompts
greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# one at a time (each sees what the previous one left), or ("burst") all submitted together
batches = [todo] if phase == "burst" else [[p] for p in todo]
out = []
for batch in batches:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], greedy, use_tqdm=False)
    out += [[list(o.outputs[0].token_ids), o.num_cached_tokens] for o in outs]
print("RESULT" + json.dumps(out))
"""


TIGHT = """
import json, sys
import numpy as np
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, scheduler, store = sys.argv[1:4]
kw = {} if scheduler == "vllm" else {"scheduler_cls": "kvsched.integrations.vllm.Scheduler"}
llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=320, dtype="float32",
          max_num_batched_tokens=320, max_num_seqs=8, seed=0, skip_tokenizer_init=True,
          enable_prefix_caching=True, num_gpu_blocks_override=12,
          kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": store}},
          **kw)
rng = np.random.default_rng(1)
prompts = [rng.integers(10, 400, 100 + 25 * i).tolist() for i in range(6)]
greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
print("RESULT" + json.dumps([[list(o.outputs[0].token_ids), o.num_cached_tokens] for o in outs]))
"""


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvsched.integrations.vllm.models import build

    return build("qwen3", tmp_path_factory.mktemp("qwen3") / "model")


def _run(
    model: Path, scheduler: str, store: Path, phase: str, log: Path | None, overlap: bool = False
) -> Any:
    env = {"KVSCHED_VLLM_LOG": str(log)} if log is not None else None
    args = (str(model), scheduler, str(store), phase)
    return _script_result(EXAMPLE, *args, env=env, overlap=overlap)


@pytest.mark.parametrize("order", ["sync", "async"])
def test_vllm_example_connector_loads_a_fresh_engine_as_vllms_own_scheduler_does(
    qwen3: Path, tmp_path: Path, order: str
):
    """Saved by one engine, loaded by a fresh one: the same tokens and cached tokens as
    vLLM's scheduler, request by request; the fresh engine's external hits are kvsched
    loads (lookup, load, settle) in its log, and both logs verify. Under vLLM's synchronous
    engine loop and under its async scheduling (against ``AsyncScheduler``)."""
    overlap = order == "async"
    ref = [_run(qwen3, "vllm", tmp_path / "ref", p, None, overlap) for p in ("save", "load")]
    logs = [tmp_path / "save.kvlog", tmp_path / "load.kvlog"]
    mine = [_run(qwen3, "kvsched", tmp_path / "mine", p, log, overlap) for p, log in zip(
        ("save", "load"), logs, strict=True)]
    assert [[t for t, _ in r] for r in mine] == [[t for t, _ in r] for r in ref]
    # 320-, 327-, 334- and 150-token prompts in 32-token blocks: the stored prompts load
    # up to their last full block short of the last token (288, 320); prompt 2 hits prompt
    # 0's loaded shared prefix locally (288: nine blocks of the 300-token prefix)
    assert [c for _, c in ref[1]] == [288, 320, 288, 0]
    assert [[c for _, c in r] for r in mine] == [[c for _, c in r] for r in ref]
    for log in logs:
        _verifies(log)
    records = [decode_record(p) for p in read_log(logs[1]).records]
    decisions = [d for r in records for d in r.decisions]
    arrived = [e.seq_id for r in records for e in r.inputs if isinstance(e, ev.RequestArrived)]
    order = {seq_id: i for i, seq_id in enumerate(arrived)}  # (prompt index by sequence)
    settled = [d for d in decisions if isinstance(d, ev.KVLoadSettled)]
    assert [(order[d.seq_id], d.num_blocks) for d in settled] == [(0, 9), (1, 10)]
    finished = [d for d in decisions if isinstance(d, ev.SequenceFinished)]
    cached = [
        (order[q], local, external)
        for d in finished
        for q, local, external in zip(
            d.seq_ids.tolist(), d.cached_local.tolist(), d.cached_external.tolist(), strict=True
        )
    ]
    # prompt 1 hits prompt 0's loaded prefix locally and loads its last stored block; (the
    # last request is retired by a step that never comes: the engine stopped)
    assert cached == [(0, 0, 288), (1, 288, 32), (2, 288, 0)]
    # each lookup answered within the step that asked it (``ExampleConnector`` knows at once)
    first = [d for d in decisions if isinstance(d, ev.KVLookupStarted)]
    got = [(order[d.seq_id], d.first_block, d.answer) for d in first]
    assert got == [(0, 0, 9), (1, 9, 10), (2, 9, 9), (3, 0, 0)]
    assert not [e for r in records for e in r.inputs if isinstance(e, ev.KVLookupAnswered)]


def test_vllm_example_connector_serves_prompts_submitted_together_as_vllms_scheduler_does(
    qwen3: Path, tmp_path: Path
):
    """The four prompts submitted together to the fresh engine: each looked up, and each
    synchronous load started and run, in the step that admits it, as under vLLM's
    scheduler, so the third prompt hits the blocks the first one loads in that same step
    (before lookups and synchronous loads ran within their step it hit nothing)."""
    runs = {}
    for kind in ("vllm", "kvsched"):
        store, log = tmp_path / f"store-{kind}", tmp_path / f"{kind}.kvlog"
        _run(qwen3, kind, store, "save", None)
        runs[kind] = _run(qwen3, kind, store, "burst", log if kind == "kvsched" else None)
    assert runs["kvsched"] == runs["vllm"]
    assert [c for _, c in runs["vllm"]] == [288, 320, 288, 0]
    _verifies(tmp_path / "kvsched.kvlog")
    decisions = [d for r in read_log(tmp_path / "kvsched.kvlog").records
                 for d in decode_record(r).decisions]  # fmt: skip
    loads = [d for d in decisions if isinstance(d, ev.KVLoadStarted)]
    assert loads and all(d.synchronous for d in loads)


def test_vllm_example_connector_under_memory_pressure_matches_vllms_own_scheduler(
    qwen3: Path, tmp_path: Path
):
    """Six prompts at once on 11 usable blocks, twice (the second engine loads what the
    first saved): requests are preempted with and after their loads, and tokens and cached
    tokens still equal vLLM's scheduler's; the logs verify."""
    runs = {}
    for kind in ("vllm", "kvsched"):
        store = tmp_path / f"store-{kind}"
        for phase in ("save", "load"):
            log = tmp_path / f"{kind}-{phase}.kvlog"
            env = {"KVSCHED_VLLM_LOG": str(log)} if kind == "kvsched" else None
            runs[kind, phase] = _script_result(TIGHT, str(qwen3), kind, str(store), env=env)
    for phase in ("save", "load"):
        assert runs["kvsched", phase] == runs["vllm", phase]
    assert [c for _, c in runs["vllm", "load"]] == [96, 96, 128, 160, 192, 0]
    for phase in ("save", "load"):
        log = tmp_path / f"kvsched-{phase}.kvlog"
        _verifies(log)
        decisions = [d for r in read_log(log).records for d in decode_record(r).decisions]
        assert any(isinstance(d, ev.SequencePreempted) for d in decisions)
    settled = [d for r in read_log(tmp_path / "kvsched-load.kvlog").records
               for d in decode_record(r).decisions if isinstance(d, ev.KVLoadSettled)]
    assert len(settled) == 5


# --------------------------------------------------------------------------- the harness

BLOCK = 16


def _store_workload(seed: int, settle: int = 12) -> list[h.Op]:
    """Two requests computed and stored by the harness's connector as they finish; after
    each prefix-cache reset, hits come from the store: an async load, a lookup answered a
    step late (``slow``), a load whose second block comes back bad (``bad``), a miss;
    ``settle`` steps before each reset (vLLM cannot reset its cache with a load out)."""
    rng = np.random.default_rng(seed)

    def fresh(n: int) -> tuple[int, ...]:
        return tuple(rng.integers(3, 400, n).tolist())

    shared = fresh(4 * BLOCK)
    a = shared + fresh(20)
    return [
        h.Add("a", a, 6),
        h.Add("b", fresh(50), 6),
        h.Steps(settle),
        h.ResetCache(),
        h.Add("c", shared + fresh(9), 6),
        h.Add("slow-d", a + fresh(3), 6),
        h.Steps(settle),
        h.ResetCache(),
        h.Add("bad-e", shared + fresh(30), 6),
        h.Add("f", fresh(40), 6),
        h.Steps(30),
    ]


ORDERS = ["sync", "async"]  # (vLLM's synchronous engine core, and its async scheduling)


def _drive_store(
    model: str,
    kind: str,
    script: list[h.Op],
    log: Path | None,
    blocks: int = 60,
    policy: str = "recompute",
    order: str = "sync",
) -> h.Trace:
    """``script`` under vLLM's scheduler ("vllm": its ``AsyncScheduler`` in the ``async``
    order) or kvsched's adapter (overlapping its steps in the ``async`` order), with the
    harness's connector."""
    HarnessConnector.reset()
    vllm_config, kv = h.configs(model, blocks, 8, 512, block_size=BLOCK, connector=True)
    vllm_config.kv_transfer_config.kv_load_failure_policy = policy
    vllm_config.scheduler_config.async_scheduling = order == "async"  # (the CPU build's: off)
    if log is not None:
        vllm_config.additional_config = {"kvsched": {"log": str(log), "check_invariants": True}}
    if kind == "vllm" and order == "async":
        kind = "vllm-async"
    sched = h.make(kind, vllm_config, kv, stats=True)
    vocab = vllm_config.model_config.get_vocab_size()
    try:
        return h.drive(sched, script, order, vocab, BLOCK)
    finally:
        sched.shutdown()


# Per call order: the connector's queries, and slow-d's loaded tokens (sync: c's loaded
# blocks are indexed when slow-d looks up, so it hits them locally and loads a's fifth
# block; async: c's load has not landed yet, so slow-d loads all five blocks)
QUERIES_AND_SLOW_LOAD = {"sync": (364, 16), "async": (428, 80)}


@pytest.mark.parametrize("order", ORDERS)
def test_vllm_adapter_drives_an_async_connector_to_vllms_steps_outputs_and_cached_tokens(
    qwen3: Path, tmp_path: Path, order: str
):
    """The harness's connector (async loads, a lookup answered late, a load with a bad
    block) under vLLM's scheduler (``AsyncScheduler`` in the async order) and under kvsched
    (overlapped steps in the async order): the same steps (each lookup asked within the
    step's planning, as vLLM asks it: a request is admitted in the step that looks it up),
    the same outputs, the same cached tokens where the load is good; the log verifies with
    its loads."""
    script = _store_workload(0)
    log = tmp_path / "store.kvlog"
    ref = _drive_store(str(qwen3), "vllm", script, None, order=order)
    mine = _drive_store(str(qwen3), "kvsched", script, log, order=order)
    assert_same_outputs(ref, mine, script, 512)
    assert set(mine.finished) == {"a", "b", "c", "slow-d", "bad-e", "f"}
    assert mine.steps == ref.steps  # (a lookup answered a step late once shifted them)
    # c: four stored blocks; slow-d: c's loaded blocks locally, a's fifth block loaded
    assert [ref.cached[n] for n in ("c", "slow-d", "f")] == [64, 80, 0]
    assert {n: mine.cached[n] for n in ref.cached if n != "bad-e"} == {
        n: c for n, c in ref.cached.items() if n != "bad-e"
    }
    # bad-e keeps its load's first block and recomputes the rest: kvsched reports the 16
    # tokens it kept, vLLM the 64 it was told at admission (its counts are not corrected)
    assert (mine.cached["bad-e"], ref.cached["bad-e"]) == (16, 64)
    _verifies(log)
    # the connector's prefix-cache counts (vLLM's external-hit metrics) are the log's
    # external hits, split as vLLM splits them (slow-d, sync order: 64 local, 16 loaded)
    # but for bad-e, which kept 16 of its 64
    records = [decode_record(p) for p in read_log(log).records]
    decisions = [d for r in records for d in r.decisions]
    external = sum(
        int(d.cached_external.sum()) for d in decisions if isinstance(d, ev.SequenceFinished)
    )
    queries, slow = QUERIES_AND_SLOW_LOAD[order]
    assert mine.external[1] == external == 64 + slow + 16
    assert ref.external == [queries, 64 + slow + 64] and mine.external[0] == queries
    inputs = [e for r in records for e in r.inputs]
    assert sum(isinstance(e, ev.KVLoadFinished) for e in inputs) == 2  # c, slow-d
    (failed,) = [e for e in inputs if isinstance(e, ev.KVLoadFailed)]
    assert failed.num_good_blocks == 1
    lookups = [d for d in decisions if isinstance(d, ev.KVLookupStarted)]
    assert [d.answer >= 0 for d in lookups] == [True, True, True, False, True, True]
    (late,) = [e for e in inputs if isinstance(e, ev.KVLookupAnswered)]  # slow-d's
    assert late.seq_id == lookups[3].seq_id


@pytest.mark.parametrize("order", ORDERS)
def test_vllm_adapter_drives_a_connector_under_memory_pressure_as_vllms_scheduler(
    qwen3: Path, tmp_path: Path, order: str
):
    """The store workload on 9 usable blocks, so a request is preempted while another's
    load is out: the same steps, outputs and victim as vLLM's scheduler (``AsyncScheduler``
    in the async order), the same cached tokens where the load is good; the log verifies.
    The victim is bad-e, which arrived before f but entered the running list after it (its
    load kept it waiting): vLLM preempts the request that entered last, and so does the
    adapter (``preemption.latest_entered``; the latest arrival would be f)."""
    script = _store_workload(1, settle=24)
    log = tmp_path / "tight.kvlog"
    ref = _drive_store(str(qwen3), "vllm", script, None, blocks=10, order=order)
    mine = _drive_store(str(qwen3), "kvsched", script, log, blocks=10, order=order)
    assert_same_outputs(ref, mine, script, 512)
    assert ref.preempted == mine.preempted == {"bad-e"}
    assert mine.steps == ref.steps
    assert {n: c for n, c in mine.cached.items() if n != "bad-e"} == {
        n: c for n, c in ref.cached.items() if n != "bad-e"
    }
    _verifies(log)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_vllm_failed_connector_loads_end_as_under_vllms_scheduler_for_each_failure_policy(
    qwen3: Path, tmp_path: Path, policy: str, order: str
):
    """A load with a bad block and one lost whole (the store gone mid-load), under vLLM's
    two ``kv_load_failure_policy`` values: recomputed (the same tokens as a run without the
    store) or ended with an error, as under vLLM's scheduler; the log verifies, nothing
    leaks (the adapter checks kvsched's invariants after every step)."""
    rng = np.random.default_rng(5)
    shared = tuple(rng.integers(3, 400, 4 * BLOCK).tolist())
    script: list[h.Op] = [
        h.Add("a", shared + tuple(rng.integers(3, 400, 20).tolist()), 4),
        h.Steps(8),
        h.ResetCache(),
        h.Add("bad-b", shared + tuple(rng.integers(3, 400, 9).tolist()), 5),
        h.Add("lost-c", shared + tuple(rng.integers(3, 400, 12).tolist()), 5),
        h.Add("d", tuple(rng.integers(3, 400, 40).tolist()), 5),
        h.Steps(30),
    ]
    log = tmp_path / "failed.kvlog"
    ref = _drive_store(str(qwen3), "vllm", script, None, policy=policy, order=order)
    mine = _drive_store(str(qwen3), "kvsched", script, log, policy=policy, order=order)
    if policy == "fail":  # (recompute: vLLM rematches lost-c's prefix locally, docs/vllm.md)
        assert mine.steps == ref.steps
    assert_same_outputs(ref, mine, script, 512)
    errors = {n for n, why in mine.finished.items() if "ERROR" in why.upper()}
    assert errors == (set() if policy == "recompute" else {"bad-b", "lost-c"})
    _verifies(log)
    inputs = [e for r in read_log(log).records for e in decode_record(r).inputs]
    failed = sorted(e.num_good_blocks for e in inputs if isinstance(e, ev.KVLoadFailed))
    assert failed == [0, 1]  # (lost-c whole; bad-b keeps the block before its bad one)


@pytest.mark.parametrize("order", ORDERS)
def test_vllm_adapter_holds_the_blocks_a_connector_still_sends_after_a_request_ends(
    qwen3: Path, tmp_path: Path, order: str
):
    """A connector that keeps a finished request's blocks while it sends them (a delayed
    free, as disaggregation producers and offloading connectors do): kvsched holds them
    (``KVHoldRequested`` .. ``KVHoldReleased``, a KVSave lease) and gives them to no other
    request meanwhile (the harness's runner checks every step); with 11 usable blocks the
    next request waits for them, as under vLLM's scheduler. The log verifies."""
    rng = np.random.default_rng(3)
    script: list[h.Op] = [
        h.Add("hold-a", tuple(rng.integers(3, 400, 80).tolist()), 4),
        h.Steps(3),
        h.Add("b", tuple(rng.integers(3, 400, 120).tolist()), 4),
        h.Add("hold-c", tuple(rng.integers(3, 400, 30).tolist()), 3),
        h.Steps(30),
    ]
    log = tmp_path / "hold.kvlog"
    ref = _drive_store(str(qwen3), "vllm", script, None, blocks=12, order=order)
    mine = _drive_store(str(qwen3), "kvsched", script, log, blocks=12, order=order)
    assert mine.steps == ref.steps
    assert_same_outputs(ref, mine, script, 512)
    assert set(mine.finished) == {"hold-a", "b", "hold-c"}
    _verifies(log)
    records = [decode_record(p) for p in read_log(log).records]
    inputs = [e for r in records for e in r.inputs]
    held = [e for e in inputs if isinstance(e, ev.KVHoldRequested)]
    released = [e for e in inputs if isinstance(e, ev.KVHoldReleased)]
    assert [e.num_blocks for e in held] == [6, 2] and len(released) == 2  # computed tokens


# --------------------------------------------------------------------------- the bridge


class Scripted:
    """A connector's scheduler side: ``answers`` per request name (tokens, async) in the
    order they are given (None: not known yet); records every call."""

    def __init__(self, answers: dict[str, list[Any]], delay_free: bool = False) -> None:
        self.answers = answers
        self.delay_free = delay_free
        self.calls: list[tuple[Any, ...]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> Any:
        self.calls.append(("match", request.request_id, num_computed))
        return self.answers[request.request_id].pop(0)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        self.calls.append(("alloc", request.request_id, blocks.get_block_ids()[0], num_external))

    def update_connector_output(self, output: Any) -> None:
        self.calls.append(("output",))

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        return self.delay_free, {"sent": block_ids}

    def take_events(self) -> list[Any]:
        return []


class Req:
    def __init__(self, name: str) -> None:
        self.request_id = name
        self.status = None


def _report(done=(), bad=(), failed=(), sent=()):  # type: ignore[no-untyped-def]
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(
        finished_recving=set(done),
        invalid_block_ids=set(bad),
        failed_recving=set(failed),
        finished_sending=set(sent),
    )


def _load(seq_id: int, blocks: list[int], first: int) -> ev.KVLoadStarted:
    n = len(blocks)
    return ev.KVLoadStarted(seq_id, np.asarray(blocks, np.int32), first, b"r" * 16, b"h" * 16 * n)


def test_a_lookup_the_connector_cannot_answer_yet_is_asked_again_each_step():
    conn = Scripted({"a": [(None, False), (None, False), (64, True)]})
    bridge = ConnectorBridge(conn, 16)
    req_of = {0: Req("a")}
    bridge.after_step([ev.KVLookupStarted(0, 2, 9, b"r" * 16, b"h" * 112)], req_of, list)
    assert bridge.inputs(req_of) == []  # (asked again: still unknown)
    assert bridge.inputs(req_of) == [ev.KVLookupAnswered(0, 2 + 4)]
    assert [c[2] for c in conn.calls] == [32, 32, 32]  # the local hit: 2 blocks of 16


def test_an_async_load_tells_the_connector_its_blocks_and_ends_when_the_worker_reports_it():
    conn = Scripted({"a": [(48, True)]})
    bridge = ConnectorBridge(conn, 16)
    req = Req("a")
    bridge.after_step([ev.KVLookupStarted(0, 1, 9, b"r" * 16, b"h" * 128)], {0: req}, list)
    assert bridge.inputs({0: req}) == [ev.KVLookupAnswered(0, 4)]
    bridge.after_step([_load(0, [7, 8, 9], 1)], {0: req}, lambda s: [3, 7, 8, 9])
    assert conn.calls[-1] == ("alloc", "a", [3, 7, 8, 9], 48)
    assert req.status.name == "WAITING_FOR_REMOTE_KVS"
    bridge.landed(_report())
    assert bridge.inputs({0: req}) == []  # (still loading)
    bridge.landed(_report(done=("a",)))
    assert bridge.inputs({0: req}) == [ev.KVLoadFinished(0)]


@pytest.mark.parametrize(
    "report, good",
    [
        ({"done": ("a",), "bad": (8,)}, 1),  # blocks before the first bad one are kept
        ({"bad": (9,)}, 2),  # (reported bad before the load ends)
        ({"failed": ("a",)}, 0),  # failed whole
    ],
)
def test_an_async_load_with_bad_blocks_fails_keeping_its_good_leading_blocks(report, good):
    conn = Scripted({"a": [(48, True)]})
    bridge = ConnectorBridge(conn, 16)
    req = Req("a")
    bridge.after_step([ev.KVLookupStarted(0, 1, 9, b"r" * 16, b"h" * 128)], {0: req}, list)
    bridge.inputs({0: req})
    bridge.after_step([_load(0, [7, 8, 9], 1)], {0: req}, lambda s: [3, 7, 8, 9])
    bridge.landed(_report(**report))
    if "done" not in report and "failed" not in report:
        bridge.landed(_report(done=("a",)))
    (got,) = bridge.inputs({0: req})
    assert isinstance(got, ev.KVLoadFailed) and got.num_good_blocks == good
    assert bridge.take_failed() == []  # (kv_load_failure_policy "recompute")


def test_under_the_fail_policy_a_failed_load_ends_its_request_in_error():
    conn = Scripted({"a": [(48, True)]})
    bridge = ConnectorBridge(conn, 16, fail_loads=True)
    req = Req("a")
    bridge.after_step([ev.KVLookupStarted(0, 1, 9, b"r" * 16, b"h" * 128)], {0: req}, list)
    bridge.inputs({0: req})
    bridge.after_step([_load(0, [7, 8, 9], 1)], {0: req}, lambda s: [3, 7, 8, 9])
    bridge.landed(_report(failed=("a",)))
    assert [s for s, _ in bridge.take_failed()] == [0] and bridge.take_failed() == []


def test_the_lookup_port_asks_within_the_step_and_says_which_hits_load_synchronously():
    """``answer`` (the step's lookup port) asks the connector at once: an async hit, a sync
    one (``sync_load``: its ``KVLoadStarted`` is synchronous, ended when started, so the
    bridge reports no ``KVLoadFinished``; the connector hears of it when the sequence
    first runs), a miss, and one not known yet (asked again at the next step's inputs)."""
    answers = {"a": [(48, True)], "b": [(32, False)], "c": [(0, False)]}
    conn = Scripted({**answers, "d": [(None, False), (16, True)]})
    bridge = ConnectorBridge(conn, 16)
    req_of = {i: Req(n) for i, n in enumerate("abcd")}

    def ask(seq_id: int, first: int) -> Any:
        return bridge.answer(ev.KVLookupStarted(seq_id, first, 9, b"r" * 16, b"h" * 16), req_of)

    assert [ask(0, 1), ask(1, 0), ask(2, 0), ask(3, 2)] == [
        LookupAnswer(4), LookupAnswer(2, sync_load=True), LookupAnswer(0), None
    ]
    started = [ev.KVLookupStarted(s, f, 9, b"r" * 16, b"h" * 16, answer=a) for s, f, a in
               [(0, 1, 4), (1, 0, 2), (2, 0, 0), (3, 2, -1)]]  # fmt: skip
    sync_load = ev.KVLoadStarted(1, np.asarray([7, 8], np.int32), 0, b"r" * 16, b"h" * 32,
                                 synchronous=True)  # fmt: skip
    bridge.after_step([*started, sync_load], req_of, lambda s: [7, 8])
    assert bridge.inputs(req_of) == [ev.KVLookupAnswered(3, 3)]  # (no KVLoadFinished for b)
    assert not any(c[0] == "alloc" for c in conn.calls)
    bridge.after_step([ev.KVLoadSettled(1, 2, 0)], req_of, lambda s: [7, 8, 11])
    assert conn.calls[-1] == ("alloc", "b", [7, 8, 11], 32)


def test_a_sync_load_ends_at_once_and_reaches_the_connector_when_its_sequence_first_runs():
    conn = Scripted({"a": [(32, False)]})
    bridge = ConnectorBridge(conn, 16)
    req = Req("a")
    bridge.after_step([ev.KVLookupStarted(0, 0, 9, b"r" * 16, b"h" * 144)], {0: req}, list)
    bridge.inputs({0: req})
    bridge.after_step([_load(0, [7, 8], 0)], {0: req}, lambda s: [7, 8])
    assert not any(c[0] == "alloc" for c in conn.calls)  # (not yet: its step has not come)
    assert bridge.inputs({0: req}) == [ev.KVLoadFinished(0)]
    bridge.after_step([ev.KVLoadSettled(0, 2, 0)], {0: req}, lambda s: [7, 8, 11])
    assert conn.calls[-1] == ("alloc", "a", [7, 8, 11], 32)

    class Out:
        def __init__(self) -> None:
            self.num_scheduled_tokens = {"a": 40}

    out: Any = Out()
    conn.build_connector_meta = lambda so: ("meta", so.kv_connector_block_state.get_block_ids("a"))
    bridge.meta(out, lambda name: ([7, 8, 11],))
    assert out.has_sync_kv_loads and out.kv_connector_metadata == ("meta", ([7, 8, 11],))
    assert out.kv_connector_block_state is None


def test_a_delayed_free_holds_the_requests_blocks_until_the_worker_reports_the_send():
    bridge = ConnectorBridge(Scripted({}, delay_free=True), 16)
    assert bridge.finished(Req("a"), 4, [1, 2]) == {"sent": [1, 2]}
    assert bridge.inputs({}) == [ev.KVHoldRequested(4, 2)]
    bridge.landed(_report())
    assert bridge.inputs({}) == []
    bridge.landed(_report(sent=("a",)))
    assert bridge.inputs({}) == [ev.KVHoldReleased(4)]
    plain = ConnectorBridge(Scripted({}), 16)
    assert plain.finished(Req("b"), 5, [1, 2]) == {"sent": [1, 2]} and plain.inputs({}) == []


def test_a_bad_block_outside_every_async_load_is_a_clear_error():
    bridge = ConnectorBridge(Scripted({}), 16)
    with pytest.raises(ConnectorError, match="bad after a step read them"):
        bridge.landed(_report(bad=(5,)))
