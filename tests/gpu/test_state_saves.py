"""``state_save_before`` and ``state_save_within`` on the torch, fingerprint and sim executors.

``state_save_before`` copies runtime -> checkpoint slots first of all, so a slot that the same
plan zeroes or restores is saved with its old content. ``state_save_within`` (row, p, slot)
saves row ``row``'s state after its first ``p`` tokens, inside its chunk: it must equal the
state a plan whose chunk ends at ``p`` leaves, and must not change the step's logits.
Torch tests use the tiny seeded hybrid (fp32, long-memory DeltaNet heads); each one also
checks that the compared states or logits would differ if the save were taken elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsched.gpu.fingerprint import EMPTY_PREFIX, FingerprintExecutor, prefix_hashes
from kvsched.gpu.model import HybridModel
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.gpu.torch_executor import TorchExecutor
from kvsched.plan import StepPlan

from .conftest import HFLogits
from .plans import SeqSpec, make_plan

BS = 16
VOCAB = 512
ATOL = 1e-4  # logits vs the oracle or another split
STATE_TOL = 1e-5  # fp32 states of two splits of the same tokens
SLOTS = 16


def executor(model: HybridModel) -> TorchExecutor:
    return TorchExecutor(model, 64, BS, SLOTS, device="cpu")


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


def spec(
    seq_id: int, tokens: Sequence[int], start: int, end: int, blocks: Sequence[int], slot: int
) -> SeqSpec:
    return SeqSpec(seq_id, tokens, start, end, blocks, slot)


def state(ex: TorchExecutor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, recurrent) of every linear layer in ``slot``: ``[n_lin, ...]`` copies."""
    return ex.cache.conv_all[:, slot].clone(), ex.cache.recurrent_all[:, slot].clone()


def assert_state_close(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str
) -> None:
    for name, g, w in zip(("conv", "recurrent"), got, want, strict=True):
        for layer in range(g.shape[0]):
            assert torch.allclose(g[layer], w[layer], rtol=STATE_TOL, atol=STATE_TOL), (
                f"{what}: {name} state of linear layer {layer} differs by "
                f"{(g[layer] - w[layer]).abs().max().item():.3g}"
            )


def state_distance(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def cache_snapshot(ex: TorchExecutor) -> list[torch.Tensor]:
    c = ex.cache
    return [t.clone() for t in (c.key_all, c.value_all, c.conv_all, c.recurrent_all)]


# ------------------------------------------------------------------ torch: state_save_within


def test_a_state_saved_within_a_chunk_equals_the_state_of_a_chunk_ending_there(
    tiny_model: HybridModel,
) -> None:
    tokens, other = prompt(1, 90), prompt(2, 20)
    blocks = range(1, 7)
    # one 90-token chunk (batched with another prefill) saving at 32 and 64
    split = executor(tiny_model)
    plan = make_plan(
        [spec(2, other, 0, 20, [10, 11], 2), spec(1, tokens, 0, 90, blocks, 1)],
        BS,
        state_save_within=[(1, 32, 9), (1, 64, 10)],
    )
    split.execute(plan)
    # reference: the same tokens in chunks ending at 32, 64 and 90
    ref = executor(tiny_model)
    at: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for lo, hi in ((0, 32), (32, 64), (64, 90)):
        ref.execute(make_plan([spec(1, tokens, lo, hi, blocks, 1)], BS))
        at[hi] = state(ref, 1)
    assert_state_close(state(split, 9), at[32], "saved within at 32")
    assert_state_close(state(split, 10), at[64], "saved within at 64")
    assert_state_close(state(split, 1), at[90], "runtime slot after the chunk")
    # the check can fail: the states at 32, 64 and 90 are far apart (conv and recurrent)
    for a, b in ((32, 64), (64, 90), (32, 90)):
        assert (at[a][0] - at[b][0]).abs().max() > 0.1, f"conv states at {a} and {b} agree"
        assert (at[a][1] - at[b][1]).abs().max() > 1e-2, f"recurrent at {a} and {b} agree"


def test_restoring_a_within_chunk_state_continues_with_the_unsplit_runs_next_token(
    tiny_model: HybridModel, hf_logits: HFLogits
) -> None:
    tokens = prompt(3, 80)
    ex = executor(tiny_model)
    out = ex.execute(
        make_plan([spec(1, tokens, 0, 80, range(1, 6), 1)], BS, state_save_within=[(0, 32, 9)])
    )
    unsplit = executor(tiny_model)
    want_token = unsplit.execute(make_plan([spec(1, tokens, 0, 80, range(1, 6), 1)], BS))
    assert out.tokens.tolist() == want_token.tokens.tolist()
    want = hf_logits(tokens)[-1]

    def resume(ckpt: int) -> tuple[torch.Tensor, int]:
        # sequence 2 shares sequence 1's first two blocks and resumes at 32 from ``ckpt``
        b = spec(2, tokens, 32, 80, [1, 2, 20, 21, 22], 2)
        res = ex.execute(make_plan([b], BS, state_zero=[2], state_restore=[(ckpt, 2)]))
        return ex.last_logits[0].clone(), int(res.tokens[0])

    got, token = resume(9)
    assert (got - want).abs().max().item() < ATOL
    assert (got - unsplit.last_logits[0]).abs().max().item() < ATOL
    assert token == int(want_token.tokens[0]) == int(want.argmax())
    # the check can fail: resuming from another state (the one after 80 tokens) is far off
    ex.execute(make_plan([], BS, state_save_before=[(1, 10)]))
    wrong, _ = resume(10)
    assert (wrong - want).abs().max().item() > 1e-2


def test_within_saves_leave_the_logits_tokens_and_runtime_states_unchanged(
    tiny_model: HybridModel, hf_logits: HFLogits
) -> None:
    a, b, c, d = prompt(4, 12), prompt(5, 70), prompt(6, 40), prompt(7, 64)

    def step_plan(within: Sequence[tuple[int, int, int]]) -> StepPlan:
        # row 0 decodes, row 1 computes 70 tokens (two saves), row 2 a 40-token prompt
        # (one save), row 3 an unsampled chunk [0, 48) (one save)
        return make_plan(
            [
                spec(1, a, 11, 12, [1], 1),
                spec(2, b, 0, 70, [2, 3, 4, 5, 6], 2),
                spec(3, c, 0, 40, [7, 8, 9], 3),
                SeqSpec(4, d, 0, 48, [10, 11, 12], 4, sample=False),
            ],
            BS,
            state_save_within=within,
        )

    outs, exs = [], []
    for within in ((), ((1, 16, 9), (1, 48, 10), (2, 32, 11), (3, 16, 12))):
        ex = executor(tiny_model)
        ex.execute(make_plan([spec(1, a, 0, 11, [1], 1)], BS))  # row 0's prefix
        outs.append(ex.execute(step_plan(within)))
        exs.append(ex)
    plain, split = exs
    assert outs[0].seq_ids.tolist() == outs[1].seq_ids.tolist() == [1, 2, 3]
    assert outs[0].tokens.tolist() == outs[1].tokens.tolist()
    assert (plain.last_logits - split.last_logits).abs().max().item() < ATOL
    for row, toks in enumerate((a, b, c)):
        want = hf_logits(toks)[-1]
        assert (split.last_logits[row] - want).abs().max().item() < ATOL, f"row {row}"
    for slot in (1, 2, 3, 4):
        assert_state_close(state(split, slot), state(plain, slot), f"runtime slot {slot}")
    # the within saves were taken (and differ from the states at the chunks' ends)
    for ckpt, runtime in ((9, 2), (10, 2), (11, 3), (12, 4)):
        assert state_distance(state(split, ckpt), state(split, runtime)) > 1e-2
        assert state_distance(state(plain, ckpt), state(split, ckpt)) > 1e-2


# ------------------------------------------------------------------ state_save_before


@pytest.mark.parametrize("overwrite", ["state_zero", "state_restore"])
def test_torch_state_save_before_saves_the_slot_before_it_is_zeroed_or_restored(
    tiny_model: HybridModel, overwrite: str
) -> None:
    ex = executor(tiny_model)
    ex.execute(make_plan([spec(1, prompt(7, 40), 0, 40, [1, 2, 3], 1)], BS))  # finished in 1
    ex.execute(make_plan([spec(2, prompt(8, 20), 0, 20, [4, 5], 2)], BS, state_save=[(2, 5)]))
    finished = state(ex, 1)
    ops: dict[str, object] = {"state_zero": [1]}
    if overwrite == "state_restore":
        ops["state_restore"] = [(5, 1)]
    # sequence 3 reuses runtime slot 1 in the same plan
    new = spec(3, prompt(9, 10), 0, 10, [6], 1)
    ex.execute(make_plan([new], BS, state_save_before=[(1, 9)], **ops))  # type: ignore[arg-type]
    assert torch.equal(state(ex, 9)[0], finished[0])
    assert torch.equal(state(ex, 9)[1], finished[1])
    # the check can fail: the slot's content after the plan is another state
    assert state_distance(state(ex, 1), finished) > 1e-2
    assert finished[1].abs().max().item() > 1e-2  # and the saved state is not zero


@pytest.mark.parametrize("overwrite", ["state_zero", "state_restore"])
def test_fingerprint_state_save_before_saves_the_slot_before_it_is_zeroed_or_restored(
    overwrite: str,
) -> None:
    ex = FingerprintExecutor(VOCAB, 64, BS, SLOTS)
    done, other = prompt(7, 40), prompt(8, 20)
    ex.execute(make_plan([spec(1, done, 0, 40, [1, 2, 3], 1)], BS, state_zero=[1]))
    ex.execute(
        make_plan([spec(2, other, 0, 20, [4, 5], 2)], BS, state_zero=[2], state_save=[(2, 5)])
    )
    finished = int(ex.state[1])
    assert finished == int(prefix_hashes(np.asarray(done), np.arange(40))[-1])
    # sequence 3 reuses runtime slot 1 in the same plan: a new prompt, or one that resumes
    # from sequence 2's checkpoint at 20 (slot 5; its partial block 5 copied into block 6)
    ops: dict[str, object] = {"state_zero": [1]}
    new, start, blocks = prompt(9, 10), 0, [6]
    if overwrite == "state_restore":
        new, start, blocks = [*other, *prompt(9, 10)], 20, [4, 6]
        ops.update(state_restore=[(5, 1)], copy_blocks=[(5, 6)])
    plan = make_plan(
        [spec(3, new, start, len(new), blocks, 1)],
        BS,
        state_save_before=[(1, 9)],
        **ops,  # type: ignore[arg-type]
    )
    ex.execute(plan)
    assert int(ex.state[9]) == finished
    assert int(ex.state[1]) != finished  # the check can fail: slot 1 now holds another prefix
    assert ex.mismatches == []


# ------------------------------------------------------------------ plans without sequences


def test_torch_applies_a_plan_with_no_sequences_and_only_state_save_before(
    tiny_model: HybridModel,
) -> None:
    ex = executor(tiny_model)
    ex.execute(make_plan([spec(1, prompt(10, 30), 0, 30, [1, 2], 1)], BS))
    plan = make_plan([], BS, step=7, state_save_before=[(1, 9)])
    assert not plan.is_empty
    assert state_distance(state(ex, 9), state(ex, 1)) > 1e-2
    out = ex.execute(plan)
    assert out.step == 7 and len(out.tokens) == 0 and len(out.seq_ids) == 0
    assert torch.equal(state(ex, 9)[0], state(ex, 1)[0])
    assert torch.equal(state(ex, 9)[1], state(ex, 1)[1])


def test_fingerprint_applies_a_plan_with_no_sequences_and_only_state_save_before() -> None:
    ex = FingerprintExecutor(VOCAB, 64, BS, SLOTS)
    ex.execute(make_plan([spec(1, prompt(10, 30), 0, 30, [1, 2], 1)], BS, state_zero=[1]))
    assert ex.state[9] != ex.state[1]
    out = ex.execute(make_plan([], BS, step=7, state_save_before=[(1, 9)]))
    assert out.step == 7 and len(out.tokens) == 0
    assert ex.state[9] == ex.state[1] and ex.mismatches == []
    ex.execute(make_plan([], BS, state_save_before=[(1, 0)]))
    assert len(ex.mismatches) == 1 and "state_save_before" in ex.mismatches[0]


def test_sim_accepts_a_plan_with_no_sequences_and_only_state_save_before() -> None:
    plan = make_plan([], BS, step=7, state_save_before=[(1, 9)])
    out = SimulatedExecutor(VOCAB).execute(plan)
    assert out.step == 7 and len(out.tokens) == 0 and len(out.seq_ids) == 0
    assert out.duration_s > 0


# ------------------------------------------------------------------ validation (torch)

_ROWS = [spec(1, prompt(11, 64), 16, 64, [1, 2, 3, 4], 1), spec(2, prompt(12, 5), 4, 5, [5], 2)]

BAD_SAVES: list[tuple[str, dict[str, object], str]] = [
    ("row out of range", {"state_save_within": [(2, 32, 9)]}, "row out of range"),
    ("negative row", {"state_save_within": [(-1, 32, 9)]}, "row out of range"),
    ("p at start", {"state_save_within": [(0, 16, 9)]}, "strictly inside"),
    ("p at end", {"state_save_within": [(0, 64, 9)]}, "strictly inside"),
    ("p past end", {"state_save_within": [(0, 80, 9)]}, "strictly inside"),
    ("p unaligned", {"state_save_within": [(0, 40, 9)]}, "multiple of block_size"),
    ("within slot out of range", {"state_save_within": [(0, 32, SLOTS)]}, "slot must be"),
    ("within null slot", {"state_save_within": [(0, 32, 0)]}, "null slot"),
    ("within runtime slot", {"state_save_within": [(0, 32, 2)]}, "runtime slot"),
    ("before dst out of range", {"state_save_before": [(1, SLOTS)]}, "state_save_before"),
    ("before src null", {"state_save_before": [(0, 9)]}, "null slot"),
    ("before dst null", {"state_save_before": [(1, 0)]}, "null slot"),
    ("before negative", {"state_save_before": [(1, -3)]}, "state_save_before"),
]


@pytest.mark.parametrize(
    ("ops", "match"), [b[1:] for b in BAD_SAVES], ids=[b[0] for b in BAD_SAVES]
)
def test_an_invalid_state_save_raises_before_anything_in_the_cache_changes(
    tiny_model: HybridModel, ops: dict[str, object], match: str
) -> None:
    ex = executor(tiny_model)
    ex.execute(make_plan([spec(1, _ROWS[0].tokens, 0, 16, [1], 1)], BS))
    ex.execute(make_plan([spec(2, _ROWS[1].tokens, 0, 4, [5], 2)], BS, state_save=[(2, 7)]))
    before = cache_snapshot(ex)
    # every other op of the plan is valid and would change the cache
    valid: dict[str, object] = {
        "state_save_before": [(1, 8)],
        "copy_blocks": [(1, 20)],
        "zero_blocks": [5],
        "state_zero": [2],
        "state_restore": [(7, 2)],
        "state_save_within": [(0, 48, 10)],
        "state_save": [(1, 11)],
    }
    plan = make_plan(_ROWS, BS, **{**valid, **ops})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        ex.execute(plan)
    for got, want in zip(cache_snapshot(ex), before, strict=True):
        assert torch.equal(got, want)
    # the check can fail: the same plan with only valid ops does change the cache
    ex.execute(make_plan(_ROWS, BS, **valid))  # type: ignore[arg-type]
    assert any(not torch.equal(g, w) for g, w in zip(cache_snapshot(ex), before, strict=True))


def test_a_within_save_of_a_row_without_a_state_slot_raises(tmp_path: Path) -> None:
    from kvsched.gpu.fixtures import build_tiny_model

    path, _ = build_tiny_model(
        tmp_path / "attn", seed=3, num_hidden_layers=2, layer_types=["full_attention"] * 2
    )
    ex = TorchExecutor(path, 16, BS, 4, device="cpu")
    plan = make_plan(
        [spec(1, prompt(13, 40), 0, 40, [1, 2, 3], 0)], BS, state_save_within=[(0, 32, 2)]
    )
    with pytest.raises(ValueError, match="has no state slot"):
        ex.execute(plan)


# ------------------------------------------------------------------ fingerprint: within


def test_fingerprint_within_save_equals_the_hash_a_plan_ending_there_leaves() -> None:
    tokens = prompt(14, 50)
    blocks = [1, 2, 3, 4]
    split = FingerprintExecutor(VOCAB, 64, BS, SLOTS)
    split.execute(
        make_plan(
            [spec(1, tokens, 0, 50, blocks, 1)],
            BS,
            state_zero=[1],
            state_save_within=[(0, 16, 5), (0, 32, 6)],
        )
    )
    ref = FingerprintExecutor(VOCAB, 64, BS, SLOTS)
    at: dict[int, int] = {}
    for lo, hi in ((0, 16), (16, 32), (32, 50)):
        ref.execute(make_plan([spec(1, tokens, lo, hi, blocks, 1)], BS, state_zero=[1] * (lo == 0)))
        at[hi] = int(ref.state[1])
    assert int(split.state[5]) == at[16] and int(split.state[6]) == at[32]
    assert int(split.state[1]) == at[50]
    assert len({at[16], at[32], at[50], EMPTY_PREFIX}) == 4  # the check can fail
    assert split.mismatches == [] and ref.mismatches == []
    # a second sequence sharing the first 32 tokens resumes from slot 6 as a cold run does
    other = [*tokens[:32], *prompt(15, 10)]
    out = split.execute(
        make_plan([spec(2, other, 32, 42, [1, 2, 7], 2)], BS, state_restore=[(6, 2)])
    )
    cold = FingerprintExecutor(VOCAB, 64, BS, SLOTS)
    want = cold.execute(make_plan([spec(2, other, 0, 42, [1, 2, 7], 2)], BS, state_zero=[2]))
    assert out.tokens.tolist() == want.tokens.tolist() and split.mismatches == []


def test_fingerprint_reports_a_within_save_into_the_null_slot_and_rejects_a_bad_p() -> None:
    ex = FingerprintExecutor(VOCAB, 64, BS, SLOTS)
    tokens = prompt(16, 40)
    ex.execute(
        make_plan(
            [spec(1, tokens, 0, 40, [1, 2, 3], 1)],
            BS,
            state_zero=[1],
            state_save_within=[(0, 16, 0)],
        )
    )
    assert len(ex.mismatches) == 1 and "state_save_within" in ex.mismatches[0]
    assert ex.state[0] == 0
    for bad in ((0, 40, 5), (0, 8, 5), (1, 16, 5), (0, 16, SLOTS)):
        with pytest.raises(ValueError, match="state_save_within"):
            ex.execute(
                make_plan([spec(2, tokens, 0, 40, [4, 5, 6], 2)], BS, state_save_within=[bad])
            )
