"""Issue 14's placement and eviction rules on the torch executor, against HF greedy output:
restores of a session turn's end state, branch-point checkpoints (saved inside a chunk, or
at the end of a chunk cut there), and eviction under a byte budget. Each test also checks
that the rule it is about was exercised (a restore of that rule's checkpoint, an eviction)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsched.config import CHECKPOINT_BUDGET, CHECKPOINT_POLICIES, ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events.types import RequestArrived
from kvsched.replay.workload import Turn, Workload, chat_workload

from .test_oracle_engine import _run_and_compare

VOCAB = 512


def _config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "model": ModelSpec(vocab_size=VOCAB, state_bytes=1000, kv_bytes_per_token=10),
        "block_size": 16,
        "num_blocks": 400,
        "max_batch": 8,
        "max_prefill_tokens": 64,
        "hybrid": True,
        "checkpoint_budget": 32,
    }
    base.update(overrides)
    return SchedulerConfig.from_dict(base)


def test_a_session_turn_restores_the_previous_turns_end_state_and_matches_hf(  # type: ignore[no-untyped-def]
    tiny_dir: Path, hf_model
) -> None:
    cfg = _config()
    wl = chat_workload(
        sessions=2,
        turns=3,
        system_tokens=20,
        user_tokens=(5, 20),
        output_tokens=(5, 12),
        vocab_size=VOCAB,
        seed=3,
    )
    engine = Engine(cfg, check_invariants=True)
    _run_and_compare(cfg, wl, tiny_dir, hf_model, engine)
    assert engine.state.ckpts.reused_by_kind.get("session_end", 0) >= 2


def _branching_workload(doc: int, tails: tuple[int, ...], seed: int) -> Workload:
    """Requests sharing a document of ``doc`` tokens, one after another (10 s apart)."""
    rng = np.random.default_rng(seed)
    document = rng.integers(1, VOCAB, doc, dtype=np.int32)
    turns = []
    for i, n in enumerate(tails):
        prompt = np.concatenate([document, rng.integers(1, VOCAB, n, dtype=np.int32)])
        turns.append(Turn(RequestArrived(i, prompt, 6), arrival_s=10.0 * i))
    return Workload("branching", tuple(turns))


@pytest.mark.parametrize("mid_chunk", [True, False], ids=["within-chunk", "chunk-cut"])
def test_a_branch_point_checkpoint_serves_later_requests_and_matches_hf(  # type: ignore[no-untyped-def]
    tiny_dir: Path, hf_model, mid_chunk: bool
) -> None:
    # A 40-token document: the second request finds 32 tokens of cached KV but no state
    # there (no rule of the first request saved one), saves it at the branch point (inside
    # its 64-token chunk, or by ending a chunk there), and the third restores it.
    # (without mid-chunk saves the "interval" rule would be ignored: the config refuses it)
    rules = CHECKPOINT_POLICIES["kvsched"]["placement"]
    rules = tuple(r for r in rules if mid_chunk or r != "interval")
    cfg = _config(mid_chunk_saves=mid_chunk, checkpoint_placement=rules)
    engine = Engine(cfg, check_invariants=True)
    wl = _branching_workload(40, (30, 27, 21), seed=4)
    summary = _run_and_compare(cfg, wl, tiny_dir, hf_model, engine)
    assert engine.state.ckpts.reused_by_kind.get("branch", 0) >= 1
    assert summary.hit_tokens >= 32


def test_eviction_under_a_byte_budget_keeps_outputs_equal_to_hf(  # type: ignore[no-untyped-def]
    tiny_dir: Path, hf_model
) -> None:
    # Room for 4 states (1,000 bytes each; a frozen partial block costs 160 more): many
    # sessions' checkpoints compete, the value eviction evicts and declines.
    # (the memory sets the count: the budget of _config would be ignored, so it is dropped)
    cfg = _config(
        checkpoint_memory=4_200, checkpoint_interval=32, checkpoint_budget=CHECKPOINT_BUDGET
    )
    engine = Engine(cfg, check_invariants=True)
    wl = chat_workload(
        sessions=4,
        turns=2,
        system_tokens=36,
        user_tokens=(5, 40),
        output_tokens=(4, 10),
        vocab_size=VOCAB,
        seed=5,
    )
    summary = _run_and_compare(cfg, wl, tiny_dir, hf_model, engine)
    ckpts = engine.state.ckpts
    assert ckpts.evictions > 0 and summary.hit_tokens > 0
    assert ckpts.used <= ckpts.capacity == 4_200
