"""Issue 14's checkpoint placement rules, value eviction and byte budgets, step by step."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.config import PLACEMENTS, ModelSpec, SchedulerConfig
from kvsched.events import types as ev
from kvsched.gpu.fingerprint import FingerprintExecutor
from kvsched.headers import LMDEPLOY_BEFORE_SCHEMA_3
from kvsched.policy.eviction import ValueEviction

from .helpers import VOCAB, Harness, config, matched, of_type, preset, request, tokens


def reserved(result) -> list[ev.CheckpointReserved]:  # type: ignore[no-untyped-def]
    return of_type(result.decisions, ev.CheckpointReserved)


def every_reserved(h: Harness) -> list[ev.CheckpointReserved]:
    return [d for r in h.results for d in reserved(r)]


def hybrid(**overrides: object) -> Harness:
    base: dict[str, object] = {"hybrid": True, "checkpoint_budget": 8}
    base.update(overrides)
    return Harness(**base)


def serve(h: Harness, seq_id: int, prompt: np.ndarray, max_tokens: int = 1, **kw: object):  # type: ignore[no-untyped-def]
    results = [h.step([request(seq_id, prompt, max_tokens=max_tokens, **kw)])]
    return results + h.run_until_idle()


def first_match(results, seq_id: int) -> ev.PrefixMatched:  # type: ignore[no-untyped-def]
    return next(matched(r)[seq_id] for r in results if seq_id in matched(r))


# ------------------------------------------------------------------------- placement


@pytest.mark.parametrize("mid_chunk", [True, False], ids=["within", "cut"])
def test_a_request_whose_cached_kv_runs_past_its_state_saves_one_at_the_branch_point(
    mid_chunk: bool,
) -> None:
    h = hybrid(mid_chunk_saves=mid_chunk, checkpoint_placement=("branch",))
    doc = tokens(40, seed=1)
    serve(h, 0, np.concatenate([doc, tokens(9, seed=2)]))  # no rule saves anything for it
    assert not h.state.ckpts.ckpts
    second = serve(h, 1, np.concatenate([doc, tokens(12, seed=3)]))
    m = first_match(second, 1)
    assert (m.num_tokens, m.kv_hit_tokens) == (0, 32)  # KV to 32, no state anywhere
    (branch,) = every_reserved(h)
    assert (branch.num_tokens, branch.kind) == (32, "branch")
    assert branch.phase == ("within" if mid_chunk else "after")
    if not mid_chunk:  # the chunk was cut at the branch point
        first_prefill = next(p for r in second for p in of_type(r.decisions, ev.PrefillScheduled))
        assert first_prefill.ends.tolist() == [32]
    third = serve(h, 2, np.concatenate([doc, tokens(7, seed=4)]))
    assert first_match(third, 2).num_tokens == 32


def test_the_sglang_policy_saves_the_branch_point_a_second_user_finds_so_the_third_hits():
    # SGLang's MambaRadixCache: branching-point states (sglang#31181), notes/peers-2026.md.
    h = hybrid(**preset("sglang"), max_prefill_tokens=128)
    system = tokens(40, seed=30)
    serve(h, 0, np.concatenate([system, tokens(30, seed=31)]))  # its sequence end only
    serve(h, 1, np.concatenate([system, tokens(25, seed=32)]))
    assert (32, "branch") in [(d.num_tokens, d.kind) for d in every_reserved(h)]
    third = serve(h, 2, np.concatenate([system, tokens(33, seed=33)]))
    assert first_match(third, 2).num_tokens == 32


def test_interval_checkpoints_are_saved_inside_a_chunk_at_every_interval() -> None:
    h = hybrid(checkpoint_placement=("interval",), checkpoint_interval=16)
    serve(h, 0, tokens(60, seed=5))  # one 60-token chunk
    saves = [(d.num_tokens, d.kind, d.phase) for d in every_reserved(h)]
    assert saves == [
        (48, "interval", "within"),
        (32, "interval", "within"),
        (16, "interval", "within"),
    ]
    plan = h.results[0].plan
    assert plan.state_save_within[:, 1].tolist() == [48, 32, 16]


def test_a_sessions_turn_end_is_saved_before_the_next_forward_and_the_next_turn_restores_it():
    h = hybrid(checkpoint_placement=("session_end",))
    first = serve(h, 0, tokens(30, seed=6), max_tokens=9, session_id=3)
    (end,) = every_reserved(h)
    assert (end.num_tokens, end.kind, end.phase) == (38, "session_end", "before")
    saving = next(r for r in first if reserved(r))
    assert saving.plan.state_save_before.tolist() == [[1 + 0, end.slot]]  # row 0's slot
    assert len(saving.plan.copy_blocks) == 1  # its partial last block, frozen first
    nxt = serve(h, 1, tokens(5, seed=7), session_id=3)
    assert first_match(nxt, 1).num_tokens == 38


def test_a_turn_without_a_session_saves_its_end_only_under_sequence_end() -> None:
    for rules, saved in ((("session_end",), 0), (("sequence_end",), 1)):
        h = hybrid(checkpoint_placement=rules)
        serve(h, 0, tokens(30, seed=8), max_tokens=4)
        assert len(every_reserved(h)) == saved


def test_decode_latest_keeps_only_the_newest_decode_checkpoint_of_a_sequence() -> None:
    h = hybrid(checkpoint_placement=("decode_latest",))
    serve(h, 0, tokens(20, seed=9), max_tokens=50)
    steps = sorted(c.step for c in h.state.ckpts.ckpts.values())
    assert steps == [64]  # saved at 32, 48 and 64; each replaced the one before
    released = [d.reason for r in h.results for d in of_type(r.decisions, ev.CheckpointReleased)]
    assert released == ["replaced", "replaced"]


def test_decode_blocks_keeps_every_block_boundary_of_decode() -> None:
    h = hybrid(checkpoint_placement=("decode_blocks",))
    serve(h, 0, tokens(20, seed=9), max_tokens=50)
    assert sorted(c.step for c in h.state.ckpts.ckpts.values()) == [32, 48, 64]


def test_the_lmdeploy_policy_saves_chunk_ends_and_the_prompt_end_only() -> None:
    h = hybrid(**preset("lmdeploy"), max_prefill_tokens=32)
    serve(h, 0, tokens(70, seed=10), max_tokens=5, session_id=1)
    assert [(d.num_tokens, d.kind) for d in every_reserved(h)] == [
        (32, "chunk_end"),
        (64, "chunk_end"),
        (70, "prompt_end"),
    ]


def test_the_vllm_align_policy_saves_block_aligned_states_only() -> None:
    h = hybrid(**preset("vllm-align"), max_prefill_tokens=32)
    serve(h, 0, tokens(70, seed=10), max_tokens=30)
    steps = [(d.num_tokens, d.kind) for d in every_reserved(h)]
    assert all(n % 16 == 0 for n, _ in steps)
    assert (64, "prompt_tail") in steps and not [n for n, _ in steps if n > 70]  # not in decode


def test_the_vllm_align_policy_stops_a_chunk_at_the_shared_prefix_junction_so_the_third_user_hits():
    # vLLM 0.32: get_computed_blocks' shared_prefix_boundary, _mamba_block_aligned_split.
    h = hybrid(**preset("vllm-align"), max_prefill_tokens=128)
    system = tokens(40, seed=20)  # two whole blocks and a part
    serve(h, 0, np.concatenate([system, tokens(30, seed=21)]))  # saves at 64 (tail), not 32
    second = serve(h, 1, np.concatenate([system, tokens(25, seed=22)]))
    m = first_match(second, 1)
    assert (m.num_tokens, m.kv_hit_tokens) == (0, 32)
    first_prefill = next(p for r in second for p in of_type(r.decisions, ev.PrefillScheduled))
    assert first_prefill.ends.tolist() == [32]  # cut at the junction, its state saved
    assert (32, "branch") in [(d.num_tokens, d.kind) for d in every_reserved(h)]
    third = serve(h, 2, np.concatenate([system, tokens(33, seed=23)]))
    assert first_match(third, 2).num_tokens == 32


# -------------------------------------------------------------------- what to keep


def _fill_with_chunk_ends(h: Harness, n: int) -> None:
    for i in range(n):
        serve(h, i, tokens(40, seed=100 + i))  # one interior checkpoint at 32 each


def test_value_eviction_declines_a_checkpoint_worth_less_than_every_one_it_would_replace():
    h = hybrid(checkpoint_budget=1, checkpoint_placement=("chunk_end",), max_prefill_tokens=32)
    serve(h, 0, tokens(70, seed=11))  # 32, then 64 (worth more: evicts 32)
    assert [c.step for c in h.state.ckpts.ckpts.values()] == [64]
    second = serve(h, 1, tokens(40, seed=13))  # 32: worth less than 64, declined
    assert [c.step for c in h.state.ckpts.ckpts.values()] == [64]
    assert [d for r in second for d in reserved(r)] == []
    serve(h, 2, tokens(140, seed=12))  # deeper ones are worth more: they replace it
    assert [c.step for c in h.state.ckpts.ckpts.values()] == [128]


def test_a_superseded_interior_checkpoint_is_evicted_before_a_deeper_one():
    h = hybrid(checkpoint_budget=2, checkpoint_placement=("chunk_end",), max_prefill_tokens=32)
    serve(h, 0, tokens(100, seed=14))  # 32 and 64 fit; 96 evicts 32 (superseded by 64)
    assert sorted(c.step for c in h.state.ckpts.ckpts.values()) == [64, 96]


def test_a_branch_checkpoint_outranks_a_chunk_end_of_equal_depth():
    h = hybrid(checkpoint_budget=1)
    ckpts, value = h.state.ckpts, ValueEviction(h.config)
    branch = value.candidate_priority(ckpts, 7, 32, "branch", 1)
    chunk = value.candidate_priority(ckpts, 8, 32, "chunk_end", 1)
    assert branch > chunk > 0
    assert value.candidate_priority(ckpts, 8, 64, "chunk_end", 1) > chunk  # deeper: worth more


def test_a_restore_raises_a_checkpoints_priority():
    h = hybrid(checkpoint_placement=("chunk_end",), max_prefill_tokens=32)
    serve(h, 0, tokens(40, seed=15))
    (c,) = h.state.ckpts.ckpts.values()
    value = ValueEviction(h.config)
    before = value.priority(h.state.ckpts, c)
    serve(h, 1, np.concatenate([tokens(40, seed=15)[:32], tokens(9, seed=16)]))
    assert c.hits == 1
    assert value.priority(h.state.ckpts, c) == pytest.approx(4 * before)


def test_a_continuation_rule_never_restored_loses_its_weight():
    h = hybrid(checkpoint_placement=("prompt_end",))
    for i in range(3):
        serve(h, i, tokens(30, seed=20 + i))
    assert h.state.ckpts.saves_by_kind == {"prompt_end": 3}
    assert ValueEviction.weights(h.state.ckpts) == {"prompt_end": pytest.approx(1 / 4)}


# ---------------------------------------------------------------------- byte budget


SMALL_STATES = ModelSpec(
    vocab_size=VOCAB, max_context=1024, state_bytes=1000, kv_bytes_per_token=10
)


def _bytes_config(memory: int) -> SchedulerConfig:
    return config(
        model=SMALL_STATES,
        hybrid=True,
        checkpoint_memory=memory,
        checkpoint_placement=("chunk_end", "prompt_end"),
        checkpoint_eviction="lru",
    )


def test_a_byte_budget_charges_a_frozen_tail_its_kv_block_and_never_overflows():
    cfg = _bytes_config(2_100)  # two states; an aligned one costs 1,000, a frozen one 1,160
    assert cfg.num_checkpoint_slots == 2
    assert (cfg.checkpoint_cost(False), cfg.checkpoint_cost(True)) == (1000, 1160)
    h = Harness(cfg)
    ckpts = h.state.ckpts
    serve(h, 0, tokens(40, seed=30))  # the prompt end at 40: frozen, 1,160
    assert [(c.step, c.cost) for c in ckpts.ckpts.values()] == [(40, 1160)]
    serve(h, 1, tokens(48, seed=31))  # 48, aligned: 1,000 more would be 2,160 > 2,100
    assert [(c.step, c.cost) for c in ckpts.ckpts.values()] == [(48, 1000)]
    assert ckpts.used == 1000 and ckpts.evictions == 1


def test_checkpoint_options_reject_unknown_rules_and_evictions_naming_them():
    with pytest.raises(ValueError, match=r"checkpoints\.placement"):
        config(hybrid=True, checkpoint_placement=("chunk_end", "everywhere"))
    with pytest.raises(ValueError, match=r"checkpoints\.eviction"):
        config(hybrid=True, checkpoint_eviction="random")
    with pytest.raises(ValueError, match="value_pair_s"):
        config(hybrid=True, value_pair_s=-1.0)
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        config(hybrid=True).with_checkpoint_policy("marconi")


def test_a_schema_2_header_runs_the_lmdeploy_rules():
    cfg = SchedulerConfig.from_log_header({"hybrid": True}, 2)
    assert cfg.checkpoints.placement == LMDEPLOY_BEFORE_SCHEMA_3["checkpoint_placement"]
    assert cfg.checkpoints.eviction == "frozen_first" and not cfg.checkpoints.mid_chunk_saves
    assert SchedulerConfig.from_log_header({"hybrid": True}, 3).checkpoints.eviction == "value"


@pytest.mark.parametrize("memory", [5_000, 50_000], ids=["tight", "roomy"])
@pytest.mark.parametrize("mid_chunk", [True, False], ids=["within", "cut"])
def test_every_rule_together_restores_only_states_that_match_their_prefix(
    mid_chunk: bool, memory: int
) -> None:
    # The fingerprint executor's states are prefix hashes: a restore of a wrong or missing
    # state (or KV) is a recorded mismatch.
    cfg = config(
        model=SMALL_STATES,
        hybrid=True,
        checkpoint_memory=memory,
        # ("interval" needs mid-chunk saves: without them it would be ignored, so refused;
        # "oracle" goes only with its own eviction, alone: tests/policy/test_oracle.py)
        checkpoint_placement=tuple(
            p for p in PLACEMENTS if p != "oracle" and (mid_chunk or p != "interval")
        ),
        **({"checkpoint_interval": 32} if mid_chunk else {}),
        decode_checkpoint_interval=32,
        mid_chunk_saves=mid_chunk,
        max_prefill_tokens=48,
    )
    h = Harness(cfg)
    h.executor = FingerprintExecutor(VOCAB, cfg.num_blocks, cfg.block_size, cfg.num_state_slots)
    doc = tokens(70, seed=40)
    for i in range(8):
        prompt = np.concatenate([doc[: 40 + 4 * i], tokens(5 + i, seed=41 + i)])
        serve(h, i, prompt, max_tokens=20, session_id=i % 3)
    assert not h.executor.mismatches, h.executor.mismatches[:3]
    ckpts = h.state.ckpts
    assert h.state.stats.ckpt_hit_tokens > 0
    if memory == 5_000:
        assert ckpts.evictions > 0
    else:  # room for all: every next turn restores its session's end state
        assert ckpts.reused_by_kind.get("sequence_end", 0) >= 3, ckpts.reused_by_kind


def test_the_eviction_ranking_gives_each_checkpoint_its_priority():
    h = hybrid(checkpoint_budget=4, checkpoint_interval=16, max_prefill_tokens=32)
    doc = tokens(50, seed=60)
    for i in range(5):
        serve(h, i, np.concatenate([doc[: 20 + 6 * i], tokens(7, seed=61 + i)]), session_id=i % 2)
    value, ckpts = ValueEviction(h.config), h.state.ckpts
    ranked = value.scored(ckpts)
    assert ranked and any(p > c.floor for p, _, c in ranked)
    assert [p for p, _, _ in ranked] == [value.priority(ckpts, c) for _, _, c in ranked]
