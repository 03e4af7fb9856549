"""The torch executor against transformers 5.24.0 ``Qwen3_5ForCausalLM`` (fp32, same weights).

Every test builds StepPlans by hand (``plans.make_plan``) with block size 16 and canonical
chunks of 32 tokens, runs them through a fresh :class:`TorchExecutor`, and compares the
logits of the sampled positions with the oracle's (atol 1e-4) and the greedy tokens exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvsched.gpu.model import HybridModel
from kvsched.gpu.torch_executor import TorchExecutor

from .conftest import HFLogits
from .plans import SeqSpec, make_plan

BS = 16
CHUNK = 32
ATOL = 1e-4
VOCAB = 512


def executor(model: HybridModel, num_blocks: int = 64, num_slots: int = 16) -> TorchExecutor:
    return TorchExecutor(model, num_blocks, BS, num_slots, device="cpu")


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    err = (got - want).abs().max().item()
    assert err < ATOL, f"{what}: max |dlogit| = {err:.3g}"


def chunks(start: int, end: int) -> list[tuple[int, int]]:
    """Canonical chunk boundaries: multiples of CHUNK; a prefix hit shortens the first."""
    out, a = [], start
    while a < end:
        b = min((a // CHUNK + 1) * CHUNK, end)
        out.append((a, b))
        a = b
    return out


class Seq:
    """Test-side sequence: tokens, block table, slot."""

    def __init__(self, seq_id: int, tokens: Sequence[int], blocks: Sequence[int], slot: int):
        self.seq_id, self.tokens, self.blocks, self.slot = seq_id, list(tokens), list(blocks), slot
        self.computed = 0

    def spec(self, end: int | None = None, sample: bool | None = None) -> SeqSpec:
        end = len(self.tokens) if end is None else end
        s = SeqSpec(self.seq_id, self.tokens, self.computed, end, self.blocks, self.slot, sample)
        self.computed = end
        return s


def run_step(
    ex: TorchExecutor,
    seqs: Sequence[Seq],
    specs: Sequence[SeqSpec],
    hf_logits: HFLogits,
    **ops: object,
) -> dict[int, torch.Tensor]:
    """Execute one plan, check every sampled sequence against the oracle, append greedy tokens."""
    plan = make_plan(specs, BS, **ops)  # type: ignore[arg-type]
    out = ex.execute(plan)
    by_id = {s.seq_id: s for s in seqs}
    sampled = [sp for sp in specs if (sp.end == len(sp.tokens) if sp.sample is None else sp.sample)]
    assert out.seq_ids.tolist() == [sp.seq_id for sp in sampled]
    got: dict[int, torch.Tensor] = {}
    for row, (sp, tok) in enumerate(zip(sampled, out.tokens.tolist(), strict=True)):
        seq = by_id[sp.seq_id]
        want = hf_logits(seq.tokens[: sp.end])[-1]
        assert_close(ex.last_logits[row], want, f"seq {sp.seq_id} at {sp.end}")
        assert tok == int(want.argmax()), f"seq {sp.seq_id}: greedy token differs"
        got[sp.seq_id] = ex.last_logits[row]
        if sp.end == len(seq.tokens):
            seq.tokens.append(tok)
    return got


# ------------------------------------------------------------------------- oracle tests


def test_oracle_single_request_prefill_and_8_decodes(tiny_model: HybridModel, hf_model) -> None:
    from transformers import DynamicCache

    tokens = prompt(1, 37)
    # oracle: manual greedy loop with the HF cache and explicit position ids
    cache = DynamicCache(config=hf_model.config)
    ref_logits, ref_tokens = [], []
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.tensor([tokens]),
            position_ids=torch.arange(len(tokens))[None],
            cache=cache,
            use_cache=True,
        )
        for i in range(9):
            last = out.logits[0, -1].float()
            ref_logits.append(last)
            ref_tokens.append(int(last.argmax()))
            if i == 8:
                break
            out = hf_model(
                input_ids=torch.tensor([[ref_tokens[-1]]]),
                position_ids=torch.tensor([[len(tokens) + i]]),
                cache=cache,
                use_cache=True,
            )
    ex = executor(tiny_model)
    seq = Seq(7, tokens, range(1, 5), slot=3)
    got_tokens = []
    for i in range(9):
        out2 = ex.execute(make_plan([seq.spec()], BS, step=i))
        assert_close(ex.last_logits[0], ref_logits[i], f"step {i}")
        got_tokens.append(int(out2.tokens[0]))
        seq.tokens.append(got_tokens[-1])
    assert got_tokens == ref_tokens
    assert seq.computed == len(tokens) + 8


def test_oracle_mixed_batch_prefill_chunk_and_decodes(
    tiny_model: HybridModel, hf_logits: HFLogits
) -> None:
    ex = executor(tiny_model)
    a = Seq(1, prompt(2, 20), [1, 2, 3], slot=1)
    b = Seq(2, prompt(3, 45), [4, 5, 6, 7], slot=2)
    c = Seq(3, prompt(4, 29), [8, 9, 10], slot=3)
    d = Seq(4, prompt(5, 3), [11, 12], slot=4)
    seqs = [a, b, c, d]
    run_step(ex, seqs, [a.spec(), b.spec(32)], hf_logits)  # a whole, b first chunk
    run_step(ex, seqs, [a.spec(), b.spec()], hf_logits)  # a decodes, b last chunk
    # one forward: two decodes of different lengths, a prefill chunk and a 3-token prompt
    run_step(ex, seqs, [a.spec(), b.spec(), c.spec(), d.spec()], hf_logits)
    for _ in range(3):
        run_step(ex, seqs, [s.spec() for s in seqs], hf_logits)
    assert [len(s.tokens) for s in seqs] == [26, 50, 33, 7]


@pytest.mark.parametrize("gdn_mode", ["chunked", "recurrent"])
def test_oracle_chunked_prefill(tiny_dir, hf_logits: HFLogits, gdn_mode: str) -> None:
    model = HybridModel.from_pretrained(tiny_dir, gdn_mode=gdn_mode)  # type: ignore[arg-type]
    ex = executor(model)
    long = Seq(1, prompt(6, 110), range(1, 9), slot=5)
    other = Seq(2, prompt(7, 10), [20, 21], slot=6)
    seqs = [long, other]
    run_step(ex, seqs, [other.spec()], hf_logits)
    for a, b in chunks(0, len(long.tokens)):
        assert long.computed == a
        # sample every chunk end (the executor samples what the plan says) to check each one
        run_step(ex, seqs, [other.spec(), long.spec(b, sample=True)], hf_logits)
    for _ in range(4):
        run_step(ex, seqs, [long.spec(), other.spec()], hf_logits)


@pytest.mark.parametrize("hit", [32, 40])
def test_oracle_restore_checkpoint(tiny_model: HybridModel, hf_logits: HFLogits, hit: int) -> None:
    """B shares A's first ``hit`` tokens and resumes from A's state checkpoint there.

    32 is block-aligned (B attaches A's blocks); 40 is not: A's partial block is snapshot
    after the forward (copy_blocks_after) and copied into B's own block before B's forward.
    """
    ex = executor(tiny_model)
    ckpt_slot, ckpt_block = 9, 30
    a = Seq(1, prompt(8, 40), [1, 2, 3, 4], slot=1)
    shared = a.tokens[:hit]
    seqs = [a]
    aligned = hit % BS == 0
    for _, hi in chunks(0, len(a.tokens)):
        at_hit = hi == hit
        run_step(
            ex,
            seqs,
            [a.spec(hi, sample=True)],
            hf_logits,
            state_save=[(a.slot, ckpt_slot)] if at_hit else [],
            copy_blocks_after=[(a.blocks[hit // BS], ckpt_block)] if at_hit and not aligned else [],
        )
    for _ in range(3):  # A moves on: its runtime slot and its partial block change
        run_step(ex, seqs, [a.spec()], hf_logits)
    full = hit // BS
    b_blocks = [*a.blocks[:full], 31, 32, 33]
    b = Seq(2, [*shared, *prompt(10, 70 - hit)], b_blocks, slot=2)
    b.computed = hit
    seqs.append(b)
    first = True
    for _, hi in chunks(hit, len(b.tokens)):
        ops: dict[str, object] = {}
        if first:
            ops["state_restore"] = [(ckpt_slot, b.slot)]
            if not aligned:
                ops["copy_blocks"] = [(ckpt_block, b.blocks[full])]
        run_step(ex, seqs, [a.spec(), b.spec(hi, sample=True)], hf_logits, **ops)
        first = False
    for _ in range(3):
        run_step(ex, seqs, [a.spec(), b.spec()], hf_logits)


def _prefix_then_continue(
    model: HybridModel, hf_logits: HFLogits, **ops: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute 64 tokens of a 96-token prompt, apply ``ops``, compute the rest.

    Returns (executor logits at the end, oracle logits there). Slot 1 holds the sequence;
    slot 9 holds another request's checkpoint at 64 (a different prompt).
    """
    ex = executor(model)
    other = Seq(5, prompt(12, 64), [10, 11, 12, 13], slot=4)
    seq = Seq(1, prompt(11, 96), range(1, 7), slot=1)
    ex.execute(make_plan([other.spec(64, sample=False)], BS, state_save=[(4, 9)]))
    ex.execute(make_plan([seq.spec(32, sample=False)], BS))
    ex.execute(make_plan([seq.spec(64, sample=False)], BS))
    ex.execute(make_plan([seq.spec(96)], BS, **ops))  # type: ignore[arg-type]
    return ex.last_logits[0], hf_logits(seq.tokens)[-1]


def test_oracle_guard_zeroed_state_changes_logits(
    tiny_model: HybridModel, hf_logits: HFLogits
) -> None:
    got, want = _prefix_then_continue(tiny_model, hf_logits)
    assert_close(got, want, "control")
    got, want = _prefix_then_continue(tiny_model, hf_logits, state_zero=[1])
    err = (got - want).abs().max().item()
    assert err > 0.1, f"zeroing the recurrent state changed logits by only {err:.3g}"


def test_oracle_catches_restore_of_another_requests_checkpoint(
    tiny_model: HybridModel, hf_logits: HFLogits
) -> None:
    got, want = _prefix_then_continue(tiny_model, hf_logits, state_restore=[(9, 1)])
    err = (got - want).abs().max().item()
    assert err > 1e-2, f"a wrong checkpoint changed logits by only {err:.3g}"


# ------------------------------------------------------------------------- other checks


def test_oracle_attention_only_model_with_null_slots(tmp_path) -> None:
    """An all-attention model runs plans whose state_slots are all 0 (today's plan_step)."""
    from transformers import Qwen3_5ForCausalLM

    from kvsched.gpu.fixtures import build_tiny_model

    path, _ = build_tiny_model(
        tmp_path / "attn", seed=3, num_hidden_layers=2, layer_types=["full_attention"] * 2
    )
    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ex = TorchExecutor(path, 16, BS, 1, device="cpu")
    s1, s2 = Seq(1, prompt(13, 40), [1, 2, 3], 0), Seq(2, prompt(14, 5), [4], 0)
    for _ in range(3):
        ex.execute(make_plan([s1.spec(), s2.spec()], BS))
        for row, s in enumerate((s1, s2)):
            with torch.no_grad():
                want = hf(
                    input_ids=torch.tensor([s.tokens]),
                    position_ids=torch.arange(len(s.tokens))[None],
                ).logits[0, -1]
            assert_close(ex.last_logits[row], want.float())
            s.tokens.append(int(want.argmax()))


def test_chunked_and_recurrent_gated_delta_agree() -> None:
    from kvsched.gpu.model import gated_delta_chunked, gated_delta_recurrent, l2norm

    gen = torch.Generator().manual_seed(0)
    b, length, h, dk, dv = 3, 150, 4, 8, 12
    q = l2norm(torch.randn(b, length, h, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(b, length, h, dk, generator=gen))
    v = torch.randn(b, length, h, dv, generator=gen)
    g = -torch.rand(b, length, h, generator=gen) * 0.1
    beta = torch.rand(b, length, h, generator=gen)
    s0 = torch.randn(b, h, dk, dv, generator=gen)
    o1, s1 = gated_delta_recurrent(q, k, v, g, beta, s0)
    o2, s2 = gated_delta_chunked(q, k, v, g, beta, s0, chunk_size=32)
    assert (o1 - o2).abs().max() < 1e-4 and (s1 - s2).abs().max() < 1e-4
    # end padding with beta = g = k = q = 0 leaves the state as it was after the real tokens
    pad = torch.zeros(b, 20, h)
    o3, s3 = gated_delta_chunked(
        torch.cat((q, torch.zeros(b, 20, h, dk)), 1),
        torch.cat((k, torch.zeros(b, 20, h, dk)), 1),
        torch.cat((v, torch.randn(b, 20, h, dv, generator=gen)), 1),
        torch.cat((g, pad), 1),
        torch.cat((beta, pad), 1),
        s0,
    )
    assert (s3 - s1).abs().max() < 1e-4 and (o3[:, :length] - o1).abs().max() < 1e-4


def test_sampling_is_seeded_and_deterministic(tiny_model: HybridModel) -> None:
    def draw(seed: int, temperature: float) -> list[int]:
        ex = executor(tiny_model)
        seqs = [Seq(i, prompt(20 + i, 12), [1 + 2 * i, 2 + 2 * i], i + 1) for i in range(4)]
        specs = [s.spec() for s in seqs]
        for sp in specs:
            sp.temperature, sp.seed = temperature, seed
        return ex.execute(make_plan(specs, BS)).tokens.tolist()

    assert draw(5, 1.0) == draw(5, 1.0)
    draws = {tuple(draw(s, 5.0)) for s in range(6)}
    assert len(draws) > 1
    greedy = draw(5, 0.0)
    assert greedy == draw(99, 0.0)


def test_plan_errors_are_reported(tiny_model: HybridModel) -> None:
    ex = executor(tiny_model, num_slots=4)
    s = Seq(1, prompt(30, 8), [1], slot=0)
    with pytest.raises(ValueError, match="state_slots"):
        ex.execute(make_plan([s.spec()], BS))  # hybrid model, null slot
    s.computed = 0
    t = Seq(2, prompt(31, 8), [2], slot=1)
    s.slot = 1
    with pytest.raises(ValueError, match="share a state slot"):
        ex.execute(make_plan([s.spec(), t.spec()], BS))
    s.computed, s.slot = 0, 1
    with pytest.raises(ValueError, match="state_restore"):
        ex.execute(make_plan([s.spec()], BS, state_restore=[(7, 1)]))
    empty = ex.execute(make_plan([], BS, step=3))
    assert empty.step == 3 and len(empty.tokens) == 0


@pytest.mark.gpu
def test_cuda_matches_cpu(tiny_model: HybridModel, tiny_dir) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cpu = executor(tiny_model)
    gpu = TorchExecutor(tiny_dir, 64, BS, 16, device="cuda")
    seqs_c = [Seq(1, prompt(40, 70), range(1, 6), 1), Seq(2, prompt(41, 9), [8], 2)]
    seqs_g = [Seq(1, prompt(40, 70), range(1, 6), 1), Seq(2, prompt(41, 9), [8], 2)]
    for _ in range(4):
        oc = cpu.execute(make_plan([s.spec() for s in seqs_c], BS))
        og = gpu.execute(make_plan([s.spec() for s in seqs_g], BS))
        assert (cpu.last_logits - gpu.last_logits.cpu()).abs().max() < 1e-3
        assert oc.tokens.tolist() == og.tokens.tolist()
        for s_c, s_g, tok in zip(seqs_c, seqs_g, oc.tokens.tolist(), strict=True):
            s_c.tokens.append(tok)
            s_g.tokens.append(tok)
