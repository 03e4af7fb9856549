"""The ``vllm-align`` preset against vLLM 0.32 itself: tiny Qwen3-Next under vLLM's DEFAULT
scheduler, then ``kvsched`` replaying the same arrivals under the preset with vLLM's block
size, pool and token budget; prefix hits compared request by request.

One vLLM engine per subprocess (``python -m kvsched.integrations.vllm.fidelity``). These need
vLLM (``scripts/test_vllm.sh`` runs them in its environment).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment: scripts/test_vllm.sh builds .venv-vllm "
    "and runs `pytest -k vllm` there",
)

from kvsched.config import CHECKPOINT_POLICIES
from kvsched.integrations.vllm.fidelity import replay_hits
from kvsched.integrations.vllm.models import VOCAB, build

TIMEOUT = 300
# (workload, vLLM's KV pool in blocks: 0 its own sizing, 16 small enough that states and
# blocks are evicted: a request of up to 6 blocks, its states, and the system prompt's;
# the per-step token budget: 0 the whole context, 1,288 two 640-token blocks and a token
# per row, so a 4 1/2-block prompt is computed in three chunks)
RUNS = {
    "junction": ("junction", 0, 0),
    "burst": ("burst", 0, 0),
    "pressure": ("junction", 16, 0),
    "chunked": ("chunked", 0, 1288),
}


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each workload run once under vLLM's default scheduler (lazily, by name)."""
    tmp = tmp_path_factory.mktemp("fidelity")
    model = build("qwen3-next", tmp / "model")
    cache: dict[str, dict[str, Any]] = {}

    class Runs(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> dict[str, Any]:
            workload, blocks, batched = RUNS[name]
            out = tmp / f"{name}.json"
            cmd = [sys.executable, "-m", "kvsched.integrations.vllm.fidelity", "--model"]
            cmd += [str(model), "--workload", workload, "--blocks", str(blocks), "--out", str(out)]
            cmd += ["--batched-tokens", str(batched)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
            assert proc.returncode == 0, proc.stderr[-4000:]
            self[name] = json.loads(Path(out).read_text())
            return self[name]

    return Runs(cache)


def _vllm_hits(run: dict[str, Any]) -> dict[str, int]:
    return {name: r["cached"] for name, r in run["requests"].items()}


@pytest.mark.parametrize("name", ["junction", "burst", "chunked"])
def test_vllm_align_replay_hits_what_vllms_default_scheduler_hits_request_by_request(
    vllm_runs: dict[str, dict[str, Any]], name: str
) -> None:
    run = vllm_runs[name]
    assert replay_hits(run, VOCAB) == _vllm_hits(run)


def test_vllm_junction_workload_hits_the_system_prompt_from_the_third_user_on(
    vllm_runs: dict[str, dict[str, Any]],
) -> None:
    run = vllm_runs["junction"]
    hits = _vllm_hits(run)
    block = run["sizes"]["block_size"]
    whole = (3 * block + block // 3) // block * block  # the system prompt's whole blocks
    assert hits["user-0"] == hits["user-1"] == 0
    assert all(hits[f"user-{i}"] == whole for i in range(2, 8))
    assert hits["user-0-turn-2"] > whole  # the first turn's prompt-tail state
    # its prompt tail, not the boundary its answer crossed (5 blocks): vLLM 0.32 keeps no
    # state that decode reaches
    assert hits["user-1-turn-2"] == 4 * block


def test_vllm_align_replay_of_a_small_pool_differs_only_where_vllms_one_pool_evicted_a_state(
    vllm_runs: dict[str, dict[str, Any]],
) -> None:
    run = vllm_runs["pressure"]
    mine, ref = replay_hits(run, VOCAB), _vllm_hits(run)
    # user 1's blocks evicted the junction state from vLLM's one pool before user 2 came;
    # kvsched counts states apart from KV blocks (docs/vllm.md): the only difference
    assert {n for n in ref if mine[n] != ref[n]} == {"user-2"}
    assert mine["user-2"] > ref["user-2"] == 0


def test_vllm_pressure_workload_evicts_a_state_the_unbounded_pool_keeps(
    vllm_runs: dict[str, dict[str, Any]],
) -> None:
    small, large = _vllm_hits(vllm_runs["pressure"]), _vllm_hits(vllm_runs["junction"])
    assert small["user-0-turn-2"] < large["user-0-turn-2"]


def test_vllm_align_preset_without_junction_stops_misses_what_vllm_hits(
    vllm_runs: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = vllm_runs["junction"]
    rules = tuple(r for r in CHECKPOINT_POLICIES["vllm-align"]["placement"] if r != "branch")
    preset = {**CHECKPOINT_POLICIES["vllm-align"], "placement": rules}
    monkeypatch.setitem(CHECKPOINT_POLICIES, "vllm-align", preset)
    assert replay_hits(run, VOCAB)["user-2"] < _vllm_hits(run)["user-2"]


def test_vllm_align_preset_with_decode_boundary_states_hits_more_than_vllm_keeps(
    vllm_runs: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = vllm_runs["junction"]
    rules = (*CHECKPOINT_POLICIES["vllm-align"]["placement"], "decode_blocks")
    preset = {**CHECKPOINT_POLICIES["vllm-align"], "placement": rules}
    monkeypatch.setitem(CHECKPOINT_POLICIES, "vllm-align", preset)
    assert replay_hits(run, VOCAB)["user-1-turn-2"] > _vllm_hits(run)["user-1-turn-2"]


def test_vllm_keeps_no_state_at_an_interior_chunk_end_and_neither_does_the_preset(
    vllm_runs: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = vllm_runs["chunked"]
    hits = _vllm_hits(run)
    # the long prompt's first chunk ended at 2 blocks; vLLM hashed only its prompt tail
    # (prefix_cache_retention_interval=0), so user 0 misses; user 1 hits user 0's junction
    assert (hits["user-0"], hits["user-1"]) == (0, 2 * run["sizes"]["block_size"])
    rules = (*CHECKPOINT_POLICIES["vllm-align"]["placement"], "chunk_end")
    preset = {**CHECKPOINT_POLICIES["vllm-align"], "placement": rules}
    monkeypatch.setitem(CHECKPOINT_POLICIES, "vllm-align", preset)
    assert replay_hits(run, VOCAB)["user-0"] > hits["user-0"]
