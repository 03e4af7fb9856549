"""Behaviour of the scheduler for hybrid models (attention + recurrent state): state checkpoints
are saved, published, matched, pinned, evicted and released through the engine, step by step."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from kvsched.engine import Engine, create_log
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.driver import run
from kvsched.replay.verify import verify_log
from kvsched.replay.workload import Turn, Workload, chat_workload
from kvsched.statemachines import CkptState, SeqState

from .helpers import (
    VOCAB,
    Harness,
    admitted,
    config,
    matched,
    of_type,
    prefills,
    preset,
    request,
    tokens,
)

LMDEPLOY = preset("lmdeploy")  # the rules some tests here are about


def hybrid(**overrides: object) -> Harness:
    """16-token blocks, 64 blocks, 8 rows, 64-token chunks, 8 checkpoint slots, lmdeploy's
    checkpoint rules (the mechanics tested here; kvsched's rules: test_checkpoint_rules.py)."""
    base: dict[str, object] = {"hybrid": True, "checkpoint_budget": 8, **LMDEPLOY}
    if overrides.get("decode_checkpoint_interval"):  # (lmdeploy's rules place no "decode")
        base["checkpoint_placement"] = (*LMDEPLOY["checkpoint_placement"], "decode")  # type: ignore[misc]
    base.update(overrides)
    return Harness(**base)


def reserved(result) -> list[ev.CheckpointReserved]:
    return of_type(result.decisions, ev.CheckpointReserved)


def released(result) -> list[ev.CheckpointReleased | ev.CheckpointAbandoned]:
    """Checkpoints dropped: released after publication, or abandoned before it."""
    return of_type(result.decisions, (ev.CheckpointReleased, ev.CheckpointAbandoned))


def evicted(result) -> list[int]:
    return [d.ckpt_id for d in of_type(result.decisions, ev.CheckpointEvicted)]


def published(result) -> list[int]:
    return [d.ckpt_id for d in of_type(result.decisions, ev.CheckpointPublished)]


def serve(h: Harness, seq_id: int, prompt: np.ndarray, max_tokens: int = 1, **kw: object):
    """Run one request to completion; returns the step results of its run."""
    results = [h.step([request(seq_id, prompt, max_tokens=max_tokens, **kw)])]
    return results + h.run_until_idle()


def steps_of(h: Harness) -> dict[int, int]:
    """Published checkpoints: step -> checkpoint id."""
    return {c.step: c.ckpt_id for c in h.state.ckpts.ckpts.values()}


def held_by_checkpoints(h: Harness) -> list[int]:
    """Per block: the references that checkpoints hold (published paths, frozen blocks)."""
    blocks = np.concatenate([np.zeros(0, np.int32), *h.state.ckpts.holders()])
    return np.bincount(blocks, minlength=h.state.pool.num_blocks).tolist()


def assert_nothing_held(h: Harness) -> None:
    state = h.state
    ck = state.ckpts
    assert ck.ckpts == {} and ck.index == {} and ck.partials == {}
    assert sorted(ck.free_slots) == list(range(ck.first_ckpt_slot, ck.num_slots))
    assert all(s.pinned_ckpt == -1 and s.n_pinned == 0 for s in state.seqs.seqs.values())
    assert state.ckpts.awaiting_ids() == []
    assert state.pool.ref.sum() == 0
    state.check_invariants()


# --------------------------------------------------------------- saves and plans


def test_a_non_aligned_prompt_end_saves_the_state_and_a_frozen_copy_of_the_partial_block():
    h = hybrid()
    first = h.step([request(0, 40, max_tokens=3)])
    (res,) = reserved(first)
    row = h.state.seq(0).row
    partial = int(h.state.seqs.table[row, 2])
    assert (res.num_tokens, res.slot) == (40, h.state.ckpts.first_ckpt_slot)
    assert res.frozen_block not in h.state.seqs.table[row, :3].tolist()
    plan = first.plan
    assert plan.state_slots.tolist() == [row + 1]
    assert plan.state_zero.tolist() == [row + 1]  # a fresh admission starts from zero
    assert plan.state_save.tolist() == [[row + 1, res.slot]]  # runtime -> checkpoint slot
    assert plan.copy_blocks_after.tolist() == [[partial, res.frozen_block]]
    assert plan.state_restore.shape == (0, 2) and plan.copy_blocks.shape == (0, 2)
    second = h.step()
    assert published(second) == [res.ckpt_id]
    c = h.state.ckpts.get(res.ckpt_id)
    assert c.state == CkptState.PUBLISHED
    assert c.path.tolist() == h.state.seqs.table[row, :2].tolist()  # full blocks only
    assert h.state.ckpts.find_partials(c.anchor) == {40: 1}
    assert second.plan.state_save.shape == (0, 2)  # nothing saved by a plain decode


def test_a_request_extending_the_prompt_restores_the_state_and_copies_the_frozen_tail():
    h = hybrid()
    prompt = tokens(40, seed=1)
    serve(h, 0, prompt)
    (c,) = h.state.ckpts.ckpts.values()
    pool_ref = h.state.pool.ref.copy()
    result = h.step([request(1, np.concatenate([prompt, tokens(20, seed=2)]))])
    seq = h.state.seq(1)
    m = matched(result)[1]
    assert (m.num_tokens, m.ckpt_id, m.blocks.tolist()) == (40, c.ckpt_id, c.path.tolist())
    assert prefills(result) == [(1, 40, 60)]
    assert (seq.pinned_ckpt, seq.n_pinned) == (c.ckpt_id, 2)
    assert c.state == CkptState.PINNED and c.pins == 1
    assert (h.state.pool.ref[c.path] == pool_ref[c.path]).all()  # pinned: no per-block refs
    runtime = seq.row + 1
    private = int(h.state.seqs.table[seq.row, 2])
    plan = result.plan
    assert private != c.frozen_block
    assert plan.state_zero.tolist() == [runtime]
    assert plan.state_restore.tolist() == [[c.slot, runtime]]  # checkpoint -> runtime slot
    assert plan.copy_blocks.tolist() == [[c.frozen_block, private]]
    assert plan.starts.tolist() == [40]
    assert h.state.stats.ckpt_hit_tokens == 40
    h.run_until_idle()
    assert c.state == CkptState.PUBLISHED and c.pins == 0


def test_checkpoints_are_saved_at_block_aligned_chunk_ends_and_at_the_prompt_end():
    h = hybrid(max_prefill_tokens=32)
    serve(h, 0, tokens(100, seed=3))
    steps = [d.num_tokens for r in h.results for d in reserved(r)]
    assert steps == [32, 64, 96, 100]
    assert sorted(steps_of(h)) == [32, 64, 96, 100]
    frozen = {c.step: c.frozen_block for c in h.state.ckpts.ckpts.values()}
    assert [s for s, f in frozen.items() if f] == [100]  # only the non-aligned one


def test_an_attention_only_model_never_saves_or_restores_state():
    h = Harness()
    prompt = tokens(40, seed=4)
    results = serve(h, 0, prompt) + serve(h, 1, np.concatenate([prompt, tokens(9, seed=5)]))
    for r in results:
        assert not reserved(r)
        plan = r.plan
        assert not plan.state_slots.any() and len(plan.state_zero) == 0
        assert len(plan.state_save) == len(plan.state_restore) == len(plan.copy_blocks_after) == 0
    assert h.state.ckpts.num_slots == 1 + h.config.max_batch


# ------------------------------------------------------------- lifecycle edges


def _reservations_until_saved(h: Harness, step: int, limit: int = 6):
    """Step until a reservation of ``step`` tokens appears: (its step result, the event)."""
    for _ in range(limit):
        result = h.step()
        for d in reserved(result):
            if d.num_tokens == step:
                return result, d
    raise AssertionError(f"no checkpoint of {step} tokens reserved again")


def test_a_failed_step_abandons_its_reservations_and_the_retried_chunk_saves_again():
    h = hybrid()
    prompt = tokens(40, seed=6)
    first = h.step([request(0, prompt, max_tokens=2)])
    (res,) = reserved(first)
    h.outcome = [ev.StepFailed(first.step, "device error")]
    retry = h.step()
    assert [(d.ckpt_id, d.reason) for d in released(retry)] == [(res.ckpt_id, "step failed")]
    assert not published(retry)
    assert res.ckpt_id not in h.state.ckpts.ckpts
    assert h.state.ckpts.index == {} and h.state.ckpts.partials == {}
    again = next((d for d in reserved(retry) if d.num_tokens == 40), None)
    saving = retry
    if again is None:  # the failed sequence was sent back to recompute: it saves later
        assert res.slot in h.state.ckpts.free_slots
        saving, again = _reservations_until_saved(h, 40)
    assert again.ckpt_id > res.ckpt_id and again.slot == res.slot  # the freed slot, reused
    runtime = h.state.seq(0).row + 1
    assert saving.plan.state_save.tolist() == [[runtime, again.slot]]
    assert published(h.step()) == [again.ckpt_id]
    h.run_until_idle()
    assert list(h.state.ckpts.ckpts) == [again.ckpt_id]


def test_a_failed_step_drops_the_frozen_block_of_its_abandoned_reservation():
    h = hybrid(num_blocks=8)
    first = h.step([request(0, 40, max_tokens=2)])
    (res,) = reserved(first)
    assert h.state.pool.ref[res.frozen_block] == 1
    h.outcome = [ev.StepFailed(first.step, "device error")]
    retry = h.step()
    again = next((d for d in reserved(retry) if d.num_tokens == 40), None)
    if again is None:
        assert h.state.pool.ref[res.frozen_block] == 0  # abandoned: its frozen block is free
        _, again = _reservations_until_saved(h, 40)
    h.run_until_idle()
    (c,) = h.state.ckpts.ckpts.values()
    assert c.ckpt_id == again.ckpt_id
    pool = h.state.pool
    assert pool.ref.tolist() == held_by_checkpoints(h)
    assert pool.ref.sum() == 2 + 1  # one path of two blocks and one frozen block: no leak


def test_two_saves_of_one_identity_in_a_step_reserve_one_checkpoint():
    h = hybrid(max_prefill_tokens=128)
    prompt = tokens(40, seed=7)
    first = h.step([request(0, prompt, max_tokens=2), request(1, prompt, max_tokens=2)])
    (a,) = reserved(first)
    assert (a.seq_id, a.num_tokens, a.kind) == (0, 40, "prompt_end")
    second = h.step()
    assert published(second) == [a.ckpt_id] and released(second) == []
    assert list(h.state.ckpts.ckpts) == [a.ckpt_id]


def test_two_sequences_pin_one_checkpoint_and_it_is_published_again_after_the_last_unpin():
    h = hybrid(max_prefill_tokens=128)
    prompt = tokens(40, seed=8)
    serve(h, 0, prompt)
    (c,) = h.state.ckpts.ckpts.values()
    short = request(1, np.concatenate([prompt, tokens(5, seed=9)]), max_tokens=1)
    long = request(2, np.concatenate([prompt, tokens(6, seed=10)]), max_tokens=4)
    result = h.step([short, long])
    pins = of_type(result.decisions, ev.CheckpointPinned)
    assert [(p.ckpt_id, p.seq_id) for p in pins] == [(c.ckpt_id, 1), (c.ckpt_id, 2)]
    assert (c.state, c.pins) == (CkptState.PINNED, 2)
    assert c not in h.engine.policy.checkpoints.eviction_order(h.state)
    done = h.step()
    assert [d.seq_id for d in of_type(done.decisions, ev.CheckpointUnpinned)] == [1]
    assert (c.state, c.pins) == (CkptState.PINNED, 1)  # more_pins: still pinned
    h.run_until_idle()
    assert (c.state, c.pins) == (CkptState.PUBLISHED, 0)  # last_pin
    order = h.engine.policy.checkpoints.eviction_order(h.state)
    assert order[-1] is c  # the last unpin refreshed its LRU stamp
    assert h.state.ckpts.restores == 2


def test_kv_pressure_evicts_unpinned_checkpoints_frozen_tails_first_then_least_recent():
    h = hybrid(num_blocks=16, max_prefill_tokens=256)
    serve(h, 0, tokens(32, seed=11))  # aligned prompt end at 32: no frozen block
    serve(h, 1, tokens(40, seed=12))  # frozen tail
    serve(h, 2, tokens(32, seed=13))
    by_seq = {c.seq_id: c.ckpt_id for c in h.state.ckpts.ckpts.values()}
    assert [c.seq_id for c in h.engine.policy.checkpoints.eviction_order(h.state)] == [1, 0, 2]
    # 15 usable blocks; checkpoints hold 2 + (2 + 1) + 2 = 7; a 144-token prompt needs 9.
    result = h.step([request(3, tokens(144, seed=14), max_tokens=20)])
    assert evicted(result) == [by_seq[1]]  # frozen tail first, and that is enough
    assert admitted(result) == [3]
    # Seq 3 holds 10 blocks once it decodes: one usable block left, a 40-token prompt needs 3.
    result = h.step([request(4, tokens(40, seed=15))])
    assert evicted(result) == [by_seq[0]]  # then the least recently used, and only it
    assert admitted(result) == [4]
    assert by_seq[2] in h.state.ckpts.ckpts


def test_a_pinned_checkpoint_is_never_evicted_under_kv_pressure():
    h = hybrid(num_blocks=16, max_prefill_tokens=256)
    prompt = tokens(40, seed=16)
    serve(h, 0, prompt)  # A: 2 path blocks + 1 frozen
    serve(h, 1, tokens(32, seed=17))  # B: 2 path blocks
    cks = {c.seq_id: c for c in h.state.ckpts.ckpts.values()}
    a, b = cks[0], cks[1]
    user = request(2, np.concatenate([prompt, tokens(8, seed=18)]), max_tokens=40, priority=5)
    h.step([user])
    assert a.state == CkptState.PINNED
    order = h.engine.policy.checkpoints.eviction_order(h.state)
    assert [c.ckpt_id for c in order][:1] == [b.ckpt_id]
    results = [h.step([request(3, tokens(160, seed=19), max_tokens=4)])]
    assert b.ckpt_id in evicted(results[0]) and admitted(results[0]) == [3]
    while 2 in h.state.seqs.seqs:
        assert h.state.seq(2).state == SeqState.RUNNING
        assert a.state == CkptState.PINNED and a.pins == 1
        results.append(h.step())
    assert a.ckpt_id not in [i for r in results for i in evicted(r)]
    assert h.state.ckpts.get(a.ckpt_id).state == CkptState.PUBLISHED


def test_an_admission_under_kv_pressure_never_evicts_the_checkpoint_it_restores():
    h = hybrid(num_blocks=16, max_prefill_tokens=256)  # 15 usable blocks
    prompt = tokens(40, seed=40)
    # Served first and with a frozen tail: the first eviction candidate by either rule.
    (target,) = [p for r in serve(h, 0, prompt) for p in published(r)]
    (other,) = [p for r in serve(h, 1, tokens(32, seed=41)) for p in published(r)]
    # Checkpoints hold 3 + 2 blocks; the hog takes the other 10 (its own save is skipped).
    hog = h.step([request(2, tokens(150, seed=42), max_tokens=5)])
    assert admitted(hog) == [2] and not evicted(hog)
    # Extends the prompt: restores ``target`` and needs one fresh block, which only an
    # eviction can give.
    result = h.step([request(3, np.concatenate([prompt, tokens(8, seed=43)]), max_tokens=2)])
    assert admitted(result) == [3]
    assert matched(result)[3].ckpt_id == target
    pins = of_type(result.decisions, ev.CheckpointPinned)
    assert [(p.ckpt_id, p.seq_id) for p in pins] == [(target, 3)]
    assert evicted(result) == [other]
    h.run_until_idle()  # (the harness checks the engine's invariants after every step)
    assert h.state.stats.requests_finished == 4


def test_eviction_happens_only_when_it_makes_the_admission_fit():
    h = hybrid(num_blocks=16, max_prefill_tokens=256)
    serve(h, 0, tokens(32, seed=20))  # holds 2 blocks
    running = h.step([request(1, tokens(150, seed=21), max_tokens=50)])
    assert admitted(running) == [1]  # 10 blocks + 1 frozen: 2 usable blocks remain
    before = set(h.state.ckpts.ckpts)
    result = h.step([request(2, tokens(100, seed=22))])  # needs 7: evicting all frees 3
    assert not admitted(result) and not evicted(result)
    assert before <= set(h.state.ckpts.ckpts)
    h.run_until_idle()
    assert h.state.stats.requests_finished == 3  # admitted once seq 1 let its blocks go


def test_slot_pressure_evicts_one_unpinned_checkpoint_and_keeps_its_kv_cached():
    h = hybrid(checkpoint_budget=1)
    old = tokens(40, seed=23)
    serve(h, 0, old)
    (c,) = h.state.ckpts.ckpts.values()
    result = h.step([request(1, tokens(48, seed=24))])
    assert evicted(result) == [c.ckpt_id]
    (res,) = reserved(result)
    assert res.slot == c.slot  # the freed slot is reused at once
    assert c.state == CkptState.EVICTED
    probe = Harness(h.config)
    probe.state.apply(request(99, old))
    hashes = probe.state.seq(99).hashes
    assert len(h.state.pool.cached_prefix(hashes, 2)) == 2  # its KV stays cached


def test_slot_pressure_skips_the_save_when_the_only_checkpoint_is_pinned():
    h = hybrid(checkpoint_budget=1)
    prompt = tokens(40, seed=25)
    serve(h, 0, prompt)
    (c,) = h.state.ckpts.ckpts.values()
    h.step([request(1, np.concatenate([prompt, tokens(8, seed=26)]), max_tokens=50)])
    assert c.state == CkptState.PINNED
    result = h.step([request(2, tokens(48, seed=27))])
    assert admitted(result) == [2]
    assert not reserved(result) and not evicted(result)
    assert list(h.state.ckpts.ckpts) == [c.ckpt_id]


def test_no_stale_entry_survives_an_eviction_so_a_later_match_misses_cleanly():
    # Index entries are removed in the same fold as the eviction: stale entries cannot exist.
    h = hybrid(checkpoint_budget=1)
    old = tokens(40, seed=28)
    serve(h, 0, old)
    (c,) = h.state.ckpts.ckpts.values()
    key, anchor = c.key, c.anchor
    serve(h, 1, tokens(48, seed=29))  # evicts it for its slot
    assert h.state.ckpts.find(key) is None
    assert h.state.ckpts.find_partials(anchor) == {}
    assert c.ckpt_id not in h.state.ckpts.index.values()
    result = h.step([request(2, np.concatenate([old, tokens(10, seed=30)]))])
    m = matched(result)[2]
    assert (m.num_tokens, m.ckpt_id, len(m.blocks)) == (0, -1, 0)
    assert m.kv_hit_tokens == 32  # the KV was still there: a hybrid miss, counted as such
    assert prefills(result) == [(2, 0, 50)]
    assert not of_type(result.decisions, ev.CheckpointPinned)


def test_no_stale_entry_survives_a_release_so_a_later_match_misses_cleanly():
    h = hybrid()
    prompt = tokens(40, seed=31)
    serve(h, 0, prompt)
    h.step([ev.DrainRequested()])
    assert h.state.ckpts.index == {} and h.state.ckpts.partials == {}
    h.step([ev.WakeRequested(), request(1, np.concatenate([prompt, tokens(4, seed=32)]))])
    m = matched(h.results[-1])[1]
    assert (m.num_tokens, m.ckpt_id, m.kv_hit_tokens) == (0, -1, 0)  # the cache was cleared


# ------------------------------------------------------------------ matching


def test_a_kv_hit_without_a_checkpoint_is_a_miss_for_hybrid_but_a_hit_for_attention_only():
    prompt = tokens(40, seed=33)
    other = np.concatenate([prompt[:36], tokens(20, seed=34)])  # shares two full blocks
    attention = Harness()
    serve(attention, 0, prompt)
    assert matched(attention.step([request(1, other)]))[1].num_tokens == 32
    h = hybrid()
    serve(h, 0, prompt)  # checkpoint only at the prompt end (40): none at 32
    m = matched(h.step([request(1, other)]))[1]
    assert (m.num_tokens, m.ckpt_id, m.kv_hit_tokens) == (0, -1, 32)
    assert h.state.stats.kv_only_hit_tokens == 32 and h.state.stats.hit_tokens == 0


def test_the_deepest_checkpoint_on_the_chain_is_chosen_partial_tails_first():
    h = hybrid(max_prefill_tokens=16)  # a checkpoint at every block and at the prompt end
    prompt = tokens(70, seed=35)
    serve(h, 0, prompt)
    assert sorted(steps_of(h)) == [16, 32, 48, 64, 70]
    longer = np.concatenate([prompt, tokens(10, seed=36)])
    m = matched(h.step([request(1, longer)]))[1]
    assert (m.num_tokens, m.ckpt_id) == (70, steps_of(h)[70])
    h.run_until_idle()
    same = prompt.copy()  # the last token is never covered: the partial at 70 is too deep
    m = matched(h.step([request(2, same)]))[2]
    assert (m.num_tokens, m.ckpt_id) == (64, steps_of(h)[64])


@pytest.mark.parametrize(
    ("mismatch_at", "hit"),
    [(0, 0), (5, 0), (20, 16), (40, 32), (63, 48), (64, 64), (68, 64)],
)
def test_a_mismatch_in_the_middle_of_the_chain_is_a_miss_at_the_right_depth(
    mismatch_at: int, hit: int
):
    h = hybrid(max_prefill_tokens=16)
    prompt = tokens(70, seed=37)
    serve(h, 0, prompt)
    steps = steps_of(h)
    other = np.concatenate([prompt, tokens(10, seed=38)])
    other[mismatch_at] = (other[mismatch_at] % (VOCAB - 1)) + 1
    m = matched(h.step([request(1, other)]))[1]
    assert m.num_tokens == hit
    assert m.ckpt_id == steps.get(hit, -1)
    assert m.kv_hit_tokens == (mismatch_at // 16) * 16
    assert prefills(h.results[-1])[0][1] == hit


@pytest.mark.parametrize(
    ("span", "hit"),
    [(None, 64), ((60, 75), 48), ((40, 70), 32), ((64, 75), 64), ((20, 33), 64)],
)
def test_a_checkpoint_inside_a_multimodal_span_is_never_matched(span, hit: int):
    # (a producer whose chunks split spans, as before schema 4, saves states inside them)
    h = hybrid(max_prefill_tokens=16, multimodal_safe=False)
    prompt = tokens(80, seed=39)
    spans = () if span is None else (ev.MultimodalSpan(span[0], span[1], b"image"),)
    serve(h, 0, prompt, mm_spans=spans)
    assert sorted(steps_of(h)) == [16, 32, 48, 64, 80]
    m = matched(h.step([request(1, prompt, mm_spans=spans)]))[1]
    assert (m.num_tokens, m.ckpt_id) == (hit, steps_of(h)[hit])  # clamped below the span
    assert m.kv_hit_tokens == 64


def test_a_partial_prompt_end_checkpoint_inside_a_multimodal_span_is_skipped():
    h = hybrid()
    prompt = tokens(40, seed=41)
    longer = np.concatenate([prompt, tokens(10, seed=42)])
    serve(h, 0, prompt)
    assert sorted(steps_of(h)) == [40]
    m = matched(h.step([request(1, longer, mm_spans=(ev.MultimodalSpan(36, 44, b"img"),))]))[1]
    assert m.num_tokens == 0  # 36 < 40 < 44: the state at 40 is inside the image
    plain = hybrid()
    serve(plain, 0, prompt)
    assert matched(plain.step([request(1, longer)]))[1].num_tokens == 40


@pytest.mark.parametrize(("content", "hit"), [(b"image-a", 40), (b"image-b", 0)])
def test_a_partial_checkpoint_depends_on_the_content_of_a_multimodal_span_in_its_tail(
    content: bytes, hit: int
):
    h = hybrid()
    prompt = tokens(40, seed=52)
    serve(h, 0, prompt, mm_spans=(ev.MultimodalSpan(34, 38, b"image-a"),))
    longer = np.concatenate([prompt, tokens(10, seed=53)])
    m = matched(h.step([request(1, longer, mm_spans=(ev.MultimodalSpan(34, 38, content),))]))
    assert m[1].num_tokens == hit  # same placeholder tokens, another image: another state


@pytest.mark.parametrize(
    ("kw", "hit"),
    [
        ({}, 40),
        ({"adapter": "lora-a"}, 0),
        ({"cache_salt": "tenant-b"}, 0),
        ({"adapter": "lora-a", "cache_salt": "tenant-b"}, 0),
    ],
)
def test_checkpoint_hits_are_isolated_by_adapter_and_cache_salt(kw: dict, hit: int):
    prompt = tokens(40, seed=43)
    longer = np.concatenate([prompt, tokens(8, seed=44)])
    h = hybrid()
    serve(h, 0, prompt)
    m = matched(h.step([request(1, longer, **kw)]))[1]
    assert m.num_tokens == hit and m.kv_hit_tokens == (32 if not kw else 0)
    same = hybrid()
    serve(same, 0, prompt, **kw)
    assert matched(same.step([request(1, longer, **kw)]))[1].num_tokens == 40


def test_decode_checkpoints_every_interval_are_matched_by_a_request_extending_the_output():
    h = hybrid(decode_checkpoint_interval=16)
    prompt = tokens(40, seed=45)
    results = serve(h, 0, prompt, max_tokens=30)
    saves = [(r.step, d.num_tokens) for r in results for d in reserved(r)]
    assert [n for _, n in saves] == [40, 48, 64]
    decode_step = next(r for r in results if any(d.num_tokens == 48 for d in reserved(r)))
    assert decode_step.plan.num_decode_tokens >= 1
    assert len(decode_step.plan.state_save) == 1 and len(decode_step.plan.copy_blocks_after) == 0
    out = [
        int(tok)
        for r in h.results
        for e in of_type(r.inputs, ev.StepExecuted)
        for s, tok in zip(e.seq_ids.tolist(), e.tokens.tolist(), strict=True)
        if s == 0
    ]
    history = np.concatenate([prompt, np.asarray(out, dtype=np.int32)])
    assert len(history) == 70
    follow = np.concatenate([history[:66], tokens(10, seed=46)])
    m = matched(h.step([request(1, follow)]))[1]
    assert (m.num_tokens, m.ckpt_id) == (64, steps_of(h)[64])
    assert h.state.stats.ckpt_hit_tokens == 64


def test_a_session_turn_matches_the_previous_turns_decode_checkpoint():
    h = hybrid(decode_checkpoint_interval=16)
    serve(h, 0, tokens(40, seed=47), max_tokens=30, session_id=5)
    assert len(h.state.sessions[5].held) == 0  # hybrid sessions hold no blocks
    assert len(h.state.sessions.history[5].tokens) == 70
    m = matched(h.step([request(1, tokens(6, seed=48), session_id=5)]))[1]
    assert m.num_tokens == 64 and m.ckpt_id >= 0


def test_aborting_a_sequence_that_restored_a_checkpoint_unpins_it_and_frees_its_own_blocks():
    h = hybrid()
    prompt = tokens(40, seed=54)
    serve(h, 0, prompt)
    (c,) = h.state.ckpts.ckpts.values()
    held_by_ckpt = h.state.pool.ref.sum()
    h.step([request(1, np.concatenate([prompt, tokens(4, seed=55)]), max_tokens=50)])
    h.step()
    result = h.step([ev.RequestAborted(1, "client gone")])
    assert [(d.ckpt_id, d.seq_id) for d in of_type(result.decisions, ev.CheckpointUnpinned)] == [
        (c.ckpt_id, 1)
    ]
    freed = of_type(result.decisions, ev.BlocksFreed)
    assert not set(freed[0].blocks.tolist()) & set(c.path.tolist())  # the pin covers those
    assert (c.state, c.pins) == (CkptState.PUBLISHED, 0)
    pool = h.state.pool
    assert pool.ref.tolist() == held_by_checkpoints(h)  # only checkpoints hold blocks now
    assert pool.ref.sum() > held_by_ckpt  # seq 1 saved its own prompt end (44) too


def test_a_preempted_sequence_unpins_its_checkpoint_and_restores_one_when_readmitted():
    h = hybrid(num_blocks=14, max_prefill_tokens=128)
    prompt = tokens(40, seed=56)
    serve(h, 0, prompt)
    (a,) = h.state.ckpts.ckpts.values()
    low = request(1, np.concatenate([prompt, tokens(8, seed=57)]), max_tokens=60, priority=0)
    high = request(2, tokens(100, seed=58), max_tokens=60, priority=1)
    h.step([low])
    assert a.state == CkptState.PINNED
    h.step([high])
    preempted_at = None
    for _ in range(200):
        r = h.step()
        if any(d.seq_id == 1 for d in of_type(r.decisions, ev.SequencePreempted)):
            unpins = of_type(r.decisions, ev.CheckpointUnpinned)
            assert [(d.ckpt_id, d.seq_id) for d in unpins] == [(a.ckpt_id, 1)]
            assert (a.state, a.pins) == (CkptState.PUBLISHED, 0)
            preempted_at = r.step
            break
    assert preempted_at is not None
    readmitted = None
    for r in h.run_until_idle():
        if 1 in admitted(r):
            readmitted = r
            break
    assert readmitted is not None
    m = matched(readmitted)[1]
    assert m.ckpt_id >= 0 and m.num_tokens >= 40 and m.num_query_tokens == 0
    pins = of_type(readmitted.decisions, ev.CheckpointPinned)
    assert [(d.ckpt_id, d.seq_id) for d in pins] == [(m.ckpt_id, 1)]
    h.run_until_idle()
    assert h.state.stats.requests_finished == 3
    assert all(c.pins == 0 for c in h.state.ckpts.ckpts.values())


# ----------------------------------------------------------------------- drain


def test_drain_releases_every_checkpoint_and_leaks_no_slot_pin_or_block():
    h = hybrid(max_prefill_tokens=32, decode_checkpoint_interval=16)
    prompt = tokens(40, seed=49)
    serve(h, 0, prompt)
    h.step([request(1, np.concatenate([prompt, tokens(30, seed=50)]), max_tokens=40)])
    h.step([request(2, tokens(70, seed=51), max_tokens=40)])
    h.step()
    assert any(c.state == CkptState.PINNED for c in h.state.ckpts.ckpts.values())
    before = sorted(h.state.ckpts.ckpts)
    result = h.step([ev.DrainRequested()])
    assert sorted(d.ckpt_id for d in released(result)) == before
    assert {d.reason for d in released(result)} == {"drain"}
    assert of_type(result.decisions, ev.CheckpointUnpinned)
    assert result.plan.is_empty
    assert_nothing_held(h)
    assert h.state.pool.num_available == h.config.num_blocks - 1
    h.step([ev.WakeRequested()])
    h.run_until_idle()
    assert h.state.stats.requests_finished == 3
    h.step([ev.DrainRequested()])
    assert_nothing_held(h)


# ------------------------------------------------------------ whole runs


def _hybrid_work(seed: int) -> Workload:
    work = chat_workload(
        sessions=5,
        turns=3,
        system_tokens=40,
        user_tokens=(5, 60),
        output_tokens=(5, 50),
        rate_per_s=200.0,
        think_s=0.01,
        vocab_size=VOCAB,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    system = tokens(50, seed=seed)
    extra = tuple(
        Turn(
            request(
                1000 + i,
                np.concatenate([system[: int(rng.integers(10, 50))], tokens(30, seed=i)]),
                max_tokens=int(rng.integers(1, 40)),
                priority=int(rng.integers(0, 3)),
            ),
            arrival_s=float(rng.uniform(0, 0.05)),
        )
        for i in range(10)
    )
    return Workload("hybrid", work.turns + extra)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_hybrid_run_under_memory_pressure_replays_without_divergence(seed: int):
    cfg = config(
        num_blocks=28,
        max_batch=5,
        max_prefill_tokens=32,
        hybrid=True,
        checkpoint_budget=4,  # (kvsched's rules: no "decode", so no decode interval)
    )
    work = _hybrid_work(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hybrid.log")
        log = create_log(path, cfg)
        engine = Engine(cfg, log=log, check_invariants=True)
        try:
            summary = run(engine, SimulatedExecutor(VOCAB), work, max_steps=5000)
            engine.step([ev.DrainRequested()], clock=summary.sim_time_s)
        finally:
            log.close()
        result = verify_log(path)
    state = engine.state
    assert summary.finished + summary.rejected == len(work.turns)
    assert summary.preemptions > 0 and state.ckpts.evictions > 0
    assert state.stats.ckpt_hit_tokens > 0
    assert result.ok, result.divergence.describe() if result.divergence else ""
    assert result.steps == state.step
    ck = state.ckpts
    assert ck.ckpts == {} and sorted(ck.free_slots) == list(range(ck.first_ckpt_slot, ck.num_slots))
    assert state.pool.ref.sum() == 0
