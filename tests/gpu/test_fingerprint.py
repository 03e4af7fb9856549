"""FingerprintExecutor: tokens depend on the KV and state contents, so a wrong cache shows.

Scheduler plans come from a real engine; each request's tokens are compared with a cold
engine serving the same prompt. Corruption tests check that the comparison can fail.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from tests.policy.helpers import config, tokens

from kvsched.config import SchedulerConfig
from kvsched.connectors import InProcessStore, TransferEngine
from kvsched.connectors.errors import CorruptValueError
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.fingerprint import EMPTY_PREFIX, FingerprintExecutor, prefix_hashes
from kvsched.plan import StepPlan

from .plans import SeqSpec, make_plan

BS = 16
GARBAGE = np.uint64(0x0BADC0FFEE0DDF00)


def _config(hybrid: bool) -> SchedulerConfig:
    """16-token blocks, 64 blocks, 8 rows, 64-token chunks (8 checkpoint slots if hybrid)."""
    return config(hybrid=True, checkpoint_budget=8) if hybrid else config()


class Served:
    """One engine on one FingerprintExecutor; serves requests one at a time to completion."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.engine = Engine(cfg, check_invariants=True)
        self.executor = FingerprintExecutor(
            cfg.model.vocab_size, cfg.num_blocks, cfg.block_size, cfg.num_state_slots
        )
        self.outputs: dict[int, list[int]] = defaultdict(list)
        self.tables: dict[int, list[int]] = {}  # seq id -> its last block table
        self.hit_tokens = 0
        self.restores = 0
        self.block_restores = 0
        self.clock = 0.0

    def serve(self, seq_id: int, prompt: np.ndarray, max_tokens: int = 5) -> list[int]:
        self._scribble_free()
        inputs: list[ev.Event] = [ev.RequestArrived(seq_id, prompt, max_tokens)]
        for _ in range(200):
            result = self.engine.step(inputs, self.clock)
            self.clock += 0.001
            inputs = [] if result.plan.is_empty else [self._execute(result.plan)]
            if not self.engine.has_work and not inputs:
                return self.outputs[seq_id]
        raise AssertionError("the engine did not become idle")

    def _scribble_free(self) -> None:
        """Free blocks and state slots hold garbage, as reused device memory does, so a
        missing copy, reset or restore cannot pass by reading a previous request's data."""
        state, ex = self.engine.state, self.executor
        ex.kv[state.pool.free] = GARBAGE
        if state.hybrid:
            runtime = [row + 1 for row in state.seqs.free_rows]
            ex.state[[*state.ckpts.free_slots, *runtime]] = GARBAGE

    def _execute(self, plan: StepPlan) -> ev.StepExecuted:
        self.hit_tokens += plan.num_hit_tokens
        self.restores += len(plan.state_restore)
        self.block_restores += len(plan.copy_blocks)
        for i, seq in enumerate(plan.seq_ids.tolist()):
            self.tables[seq] = plan.block_tables[i, : plan.num_blocks[i]].tolist()
        out = self.executor.execute(plan)
        for seq, tok in zip(out.seq_ids.tolist(), out.tokens.tolist(), strict=True):
            self.outputs[seq].append(tok)
        return out


def _cold(cfg: SchedulerConfig, prompt: np.ndarray) -> list[int]:
    served = Served(cfg)
    out = served.serve(99, prompt)
    assert served.executor.mismatches == []
    return out


# ------------------------------------------------------------------ through the engine


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_identical_prompts_give_the_cold_runs_tokens_through_a_prefix_cache_hit(
    hybrid: bool,
) -> None:
    cfg, prompt = _config(hybrid), tokens(100, seed=5)
    served = Served(cfg)
    first = served.serve(0, prompt)
    second = served.serve(1, prompt)
    assert served.hit_tokens > 0
    assert served.restores > 0 if hybrid else served.restores == 0
    assert first == second == _cold(cfg, prompt)
    assert len(first) == 5 and len(set(first)) > 1
    assert served.executor.mismatches == []


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_a_prompt_extending_a_served_one_gives_the_cold_runs_tokens(hybrid: bool) -> None:
    # hybrid: the hit ends at the first prompt's unaligned end (100), so the engine restores
    # the checkpoint state and copies its frozen partial block
    cfg, base = _config(hybrid), tokens(100, seed=6)
    longer = np.concatenate([base, tokens(30, seed=7)])
    served = Served(cfg)
    served.serve(0, base)
    out = served.serve(1, longer)
    assert served.hit_tokens >= 96
    if hybrid:
        assert served.restores == served.block_restores == 1
    assert out == _cold(cfg, longer)
    assert served.executor.mismatches == []


@pytest.mark.parametrize("which", ["first", "last"])
def test_corrupting_a_reused_kv_block_changes_the_hit_requests_tokens(which: str) -> None:
    # "first": only the context digest sees it (the chunk starts after that block);
    # "last": the hit's resume position reads it directly
    cfg, prompt = _config(False), tokens(100, seed=8)
    served = Served(cfg)
    served.serve(0, prompt)
    reused = served.tables[0][: 96 // BS]
    if which == "first":
        served.executor.kv[reused[0], 3] ^= np.uint64(1)
    else:
        served.executor.kv[reused[-1], -1] ^= np.uint64(1)  # position 95: the resume point
    out = served.serve(1, prompt)
    assert served.hit_tokens == 96 and served.tables[1][: len(reused)] == reused
    assert out != _cold(cfg, prompt)


def test_corrupting_a_hybrid_checkpoint_state_records_a_mismatch_and_changes_the_tokens() -> None:
    cfg, prompt = _config(True), tokens(100, seed=9)
    served = Served(cfg)
    served.serve(0, prompt)
    slots = [c.slot for c in served.engine.state.ckpts.ckpts.values()]
    assert slots
    served.executor.state[slots] ^= np.uint64(1 << 40)
    out = served.serve(1, prompt)
    assert served.restores == 1
    assert out != _cold(cfg, prompt)
    assert any("state slot" in m for m in served.executor.mismatches)


# ------------------------------------------------------------------ hand-built plans


def _prefill(ex: FingerprintExecutor, toks: np.ndarray, end: int, blocks: list[int]) -> None:
    """Compute toks[:end] into ``blocks`` with hybrid state slot 1 (reset first)."""
    ex.execute(make_plan([SeqSpec(0, toks, 0, end, blocks, slot=1)], BS, state_zero=[1]))


def _resume(
    ex: FingerprintExecutor, toks: np.ndarray, start: int, blocks: list[int], slot: int
) -> list[int]:
    """Compute toks[start:] on ``blocks`` from state ``slot``; returns the sampled tokens."""
    plan = make_plan([SeqSpec(0, toks, start, len(toks), blocks, slot=slot)], BS, step=1)
    out: list[int] = ex.execute(plan).tokens.tolist()
    return out


def test_chunked_prefix_hashes_equal_the_one_shot_hashes() -> None:
    toks, pos = tokens(50, seed=1), np.arange(50)
    whole = prefix_hashes(toks, pos)
    head = prefix_hashes(toks[:20], pos[:20])
    tail = prefix_hashes(toks[20:], pos[20:], prev=int(head[-1]))
    assert np.array_equal(np.concatenate([head, tail]), whole)
    assert whole[0] != prefix_hashes(toks[:1], pos[1:2])[0]  # position matters


def test_a_hybrid_chunk_whose_state_was_not_restored_records_a_mismatch() -> None:
    toks = tokens(45, seed=2)
    ex = FingerprintExecutor(1000, 16, BS, num_state_slots=4)
    _prefill(ex, toks, 40, [1, 2, 3])
    assert ex.state[1] == prefix_hashes(toks[:40], np.arange(40))[-1]
    _resume(ex, toks, 40, [1, 2, 3], slot=2)  # slot 2 never reset nor restored
    assert len(ex.mismatches) == 1 and "state slot 2" in ex.mismatches[0]


def test_a_hybrid_chunk_after_a_reset_without_restore_records_a_mismatch() -> None:
    toks = tokens(45, seed=3)
    ex = FingerprintExecutor(1000, 16, BS, num_state_slots=4)
    _prefill(ex, toks, 40, [1, 2, 3])
    plan = make_plan([SeqSpec(0, toks, 40, 45, [1, 2, 3], slot=1)], BS, state_zero=[1])
    ex.execute(plan)
    assert len(ex.mismatches) == 1 and hex(EMPTY_PREFIX) in ex.mismatches[0]


def test_writing_into_the_null_block_is_recorded_not_raised() -> None:
    ex = FingerprintExecutor(1000, 8, BS)
    ex.execute(make_plan([SeqSpec(3, tokens(20, seed=4), 0, 20, [0, 2])], BS))
    assert any("null block" in m for m in ex.mismatches)
    assert not ex.kv[0].any() and ex.kv[2, :4].all()


# ------------------------------------------------------------- BlockBuffer / StateBuffer


def test_blocks_round_trip_as_bytes_and_a_wrong_size_is_a_corrupt_value() -> None:
    ex, other = FingerprintExecutor(1000, 8, BS), FingerprintExecutor(1000, 8, BS)
    ex.execute(make_plan([SeqSpec(0, tokens(20, seed=5), 0, 20, [3, 5])], BS))
    assert ex.block_bytes == BS * 8 == len(ex.read_block(3))
    other.write_block(6, ex.read_block(3))
    assert np.array_equal(other.kv[6], ex.kv[3]) and ex.kv[3].all()
    with pytest.raises(CorruptValueError):
        other.write_block(6, ex.read_block(3)[:-1])


def test_states_round_trip_as_bytes_and_a_wrong_size_is_a_corrupt_value() -> None:
    ex = FingerprintExecutor(1000, 8, BS, num_state_slots=3)
    ex.state[1] = np.uint64(0xDEADBEEF12345678)
    conv, recurrent = ex.read_state(1)
    assert (len(conv), recurrent) == (8, b"")
    ex.write_state(2, conv, recurrent)
    assert ex.state[2] == ex.state[1]
    with pytest.raises(CorruptValueError):
        ex.write_state(2, conv + b"\0", b"")
    with pytest.raises(CorruptValueError):
        ex.write_state(2, conv, b"\0")


def test_writing_block_0_or_state_slot_0_raises_value_error() -> None:
    ex = FingerprintExecutor(1000, 8, BS, num_state_slots=3)
    with pytest.raises(ValueError, match="block 0"):
        ex.write_block(0, bytes(ex.block_bytes))
    with pytest.raises(ValueError, match="slot 0"):
        ex.write_state(0, bytes(8), b"")


def test_blocks_and_state_moved_by_the_transfer_engine_resume_with_the_cold_tokens() -> None:
    toks = tokens(45, seed=6)
    src = FingerprintExecutor(1000, 16, BS, num_state_slots=4)
    dst = FingerprintExecutor(1000, 16, BS, num_state_slots=4)
    _prefill(src, toks, 40, [1, 2, 3])
    store = InProcessStore()
    keys = ["b0", "b1", "b2"]
    saver = TransferEngine(store, blocks=src, states=src)
    saver.start_save(1, keys, [1, 2, 3], state=("s40", 1))
    assert saver.wait_idle() and saver.poll().finished_saves == {1}
    loader = TransferEngine(store, blocks=dst, states=dst)
    loader.start_load(7, keys, [9, 5, 11], state=("s40", 3))
    assert loader.wait_idle() and loader.poll().finished_loads == {7}
    saver.close()
    loader.close()

    fresh = FingerprintExecutor(1000, 16, BS, num_state_slots=4)
    plan = make_plan([SeqSpec(0, toks, 0, 45, [1, 2, 3], slot=1)], BS, state_zero=[1])
    want = fresh.execute(plan).tokens.tolist()
    assert _resume(dst, toks, 40, [9, 5, 11], slot=3) == want
    assert _resume(src, toks, 40, [1, 2, 3], slot=1) == want
    assert src.mismatches == dst.mismatches == fresh.mismatches == []
