"""A KV and state load from the store (issue 6), checked against transformers.

Engine A (a :class:`TorchExecutor`) prefills a prompt with hand-built plans, checkpoints its
recurrent state at the last block boundary (``state_save``) and saves its full KV blocks and
that checkpoint into an :class:`InProcessStore` through the connectors' ``TransferEngine``
(keys from ``connectors.keys``: namespace root + the prompt's chained block hashes). A fresh
executor B (its own cache, other block ids, another state slot, the target memory filled with
noise) loads them through ``TransferEngine.start_load``, computes only the uncached suffix and
decodes; its logits must equal transformers' ``Qwen3_5ForCausalLM`` (atol 1e-4, same greedy
tokens) at every step. A guard loads another prompt's state checkpoint instead and must see
the logits move by more than 1e-2, so the comparison can fail.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsched.config import ModelSpec
from kvsched.connectors import InProcessStore, TransferEngine, TransferReport
from kvsched.connectors.keys import block_key, state_key
from kvsched.gpu.model import HybridModel
from kvsched.gpu.torch_executor import TorchExecutor
from kvsched.gpu.transfer_buffer import TorchCacheBuffer
from kvsched.identity import chain_hashes, namespace_root

from .conftest import HFLogits
from .plans import SeqSpec, make_plan

ATOL = 1e-4
VOCAB = 512
PROMPT = 72  # 64 cached tokens (block-aligned for 16 and 32) + an 8-token suffix
HIT = 64
DECODES = 6
TIMEOUT_S = 10.0


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, VOCAB, n)]


def wait_report(engine: TransferEngine, timeout_s: float = TIMEOUT_S) -> TransferReport:
    """Poll until a job ended (bounded)."""
    deadline = time.monotonic() + timeout_s
    report = engine.poll()
    while report.is_empty:
        assert time.monotonic() < deadline, "transfer neither finished nor failed"
        time.sleep(0.002)
        report = engine.poll()
    return report


class Seq:
    def __init__(self, seq_id: int, tokens: Sequence[int], blocks: Sequence[int], slot: int):
        self.seq_id, self.tokens, self.blocks, self.slot = seq_id, list(tokens), list(blocks), slot
        self.computed = 0

    def step(self, ex: TorchExecutor, end: int | None = None, **ops: object) -> torch.Tensor:
        """Compute ``[computed, end)`` (default: to the last token) and return its last logits;
        a step that reaches the last token appends the greedy token."""
        end = len(self.tokens) if end is None else end
        spec = SeqSpec(self.seq_id, self.tokens, self.computed, end, self.blocks, self.slot, True)
        out = ex.execute(make_plan([spec], ex.block_size, **ops))  # type: ignore[arg-type]
        self.computed = end
        if end == len(self.tokens):
            self.tokens.append(int(out.tokens[0]))
        return ex.last_logits[0].clone()


def _root(bs: int) -> bytes:
    return namespace_root(ModelSpec(name="tiny-qwen3.5"), bs)


def _save_prefix(
    ex: TorchExecutor,
    store: InProcessStore,
    tokens: Sequence[int],
    blocks: Sequence[int],
    slot: int,
    ckpt_slot: int,
    save_id: int,
) -> list[bytes]:
    """Prefill ``tokens`` on ``ex`` (chunks ending at HIT and at the end), checkpoint the state
    at HIT, and save the HIT // bs full blocks + the checkpoint. Returns the block hashes."""
    bs = ex.block_size
    seq = Seq(save_id, tokens, blocks, slot)
    seq.step(ex, HIT // 2)
    seq.step(ex, HIT, state_save=[(slot, ckpt_slot)])
    if len(tokens) > HIT:
        seq.step(ex)  # A moves on: its runtime slot is past the checkpoint
    root = _root(bs)
    hashes = chain_hashes(root, np.asarray(tokens[:HIT]), bs)
    assert len(hashes) == HIT // bs
    buf = TorchCacheBuffer(ex)
    engine = TransferEngine(store, buf, buf)
    keys = [block_key(root, h) for h in hashes]
    engine.start_save(
        save_id, keys, blocks[: len(hashes)], (state_key(root, hashes[-1]), ckpt_slot)
    )
    report = wait_report(engine)
    engine.close()
    assert report.finished_saves == {save_id}, report
    assert store.batch_exists([*keys, state_key(root, hashes[-1])]) == [True] * (len(keys) + 1)
    return hashes


def _load_into_fresh(
    model: HybridModel,
    store: InProcessStore,
    bs: int,
    block_hashes: Sequence[bytes],
    state_hash: bytes,
    blocks: Sequence[int],
    slot: int,
    device: str = "cpu",
) -> tuple[TorchExecutor, float]:
    """A fresh executor with noise in ``blocks``/``slot``, then a store load into them."""
    ex = TorchExecutor(model, 32, bs, 8, device=device)
    gen = torch.Generator().manual_seed(123)
    cache = ex.cache
    with torch.no_grad():
        for t in (cache.key_all, cache.value_all, cache.conv_all, cache.recurrent_all):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        cache.key_all[:, 0] = 0
        cache.value_all[:, 0] = 0
        cache.conv_all[:, 0] = 0
        cache.recurrent_all[:, 0] = 0
    root = _root(bs)
    buf = TorchCacheBuffer(ex)
    engine = TransferEngine(store, buf, buf, batch_blocks=2)
    keys = [block_key(root, h) for h in block_hashes]
    n = len(keys)
    t0 = time.perf_counter()
    engine.start_load(9, keys, blocks[:n], state=(state_key(root, state_hash), slot))
    report = wait_report(engine)
    elapsed = time.perf_counter() - t0
    engine.close()
    assert report.finished_loads == {9} and not report.failed_loads, report
    return ex, elapsed


@pytest.mark.parametrize("bs", [16, 32])
def test_oracle_load_from_store_then_suffix_and_decodes(
    tiny_model: HybridModel, hf_logits: HFLogits, bs: int
) -> None:
    tokens = prompt(61, PROMPT)
    store = InProcessStore()
    a = TorchExecutor(tiny_model, 16, bs, 4, device="cpu")
    a_blocks = list(range(1, 1 + -(-PROMPT // bs)))
    hashes = _save_prefix(a, store, tokens, a_blocks, slot=1, ckpt_slot=3, save_id=1)

    # B: other block ids (not ascending), another slot, noise underneath
    b_blocks = [20, 7, 13, 25, 9, 11][: -(-(PROMPT + DECODES) // bs)]
    b_slot = 5
    b, load_s = _load_into_fresh(tiny_model, store, bs, hashes, hashes[-1], b_blocks, b_slot)
    # the load is byte-exact: A's blocks and A's checkpoint, in B's places
    n = len(hashes)
    for a_blk, b_blk in zip(a_blocks[:n], b_blocks[:n], strict=True):
        assert torch.equal(a.cache.key_all[:, a_blk], b.cache.key_all[:, b_blk])
        assert torch.equal(a.cache.value_all[:, a_blk], b.cache.value_all[:, b_blk])
    assert torch.equal(a.cache.conv_all[:, 3], b.cache.conv_all[:, b_slot])
    assert torch.equal(a.cache.recurrent_all[:, 3], b.cache.recurrent_all[:, b_slot])
    assert load_s < TIMEOUT_S

    seq = Seq(2, tokens, b_blocks, b_slot)
    seq.computed = HIT  # only the uncached suffix is computed
    for i in range(1 + DECODES):
        n_known = len(seq.tokens)
        got = seq.step(b)
        want = hf_logits(seq.tokens[:n_known])[-1]
        err = (got - want).abs().max().item()
        assert err < ATOL, f"bs {bs}, step {i} (context {n_known}): max |dlogit| = {err:.3g}"
        assert seq.tokens[-1] == int(want.argmax()), f"bs {bs}, step {i}: greedy token differs"
    assert seq.computed == PROMPT + DECODES


def test_oracle_catches_a_load_of_another_prompts_state(
    tiny_model: HybridModel, hf_logits: HFLogits
) -> None:
    bs = 16
    tokens, other = prompt(61, PROMPT), prompt(62, HIT)
    store = InProcessStore()
    a = TorchExecutor(tiny_model, 16, bs, 4, device="cpu")
    hashes = _save_prefix(a, store, tokens, [1, 2, 3, 4, 5], slot=1, ckpt_slot=3, save_id=1)
    other_hashes = _save_prefix(a, store, other, [6, 7, 8, 9], slot=2, ckpt_slot=3, save_id=2)
    want = hf_logits(tokens)[-1]

    def suffix_logits(state_hash: bytes) -> torch.Tensor:
        b, _ = _load_into_fresh(tiny_model, store, bs, hashes, state_hash, [20, 7, 13, 25, 9], 5)
        seq = Seq(2, tokens, [20, 7, 13, 25, 9], 5)
        seq.computed = HIT
        return seq.step(b)

    control = (suffix_logits(hashes[-1]) - want).abs().max().item()
    assert control < ATOL, f"control: max |dlogit| = {control:.3g}"
    err = (suffix_logits(other_hashes[-1]) - want).abs().max().item()
    assert err > 1e-2, f"another prompt's state changed the logits by only {err:.3g}"


@pytest.mark.gpu
def test_oracle_cuda_executor_loads_what_a_cpu_executor_saved(
    tiny_model: HybridModel, tiny_dir: Path, hf_logits: HFLogits
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bs = 16
    tokens = prompt(61, PROMPT)
    store = InProcessStore()
    a = TorchExecutor(tiny_model, 16, bs, 4, device="cpu")
    hashes = _save_prefix(a, store, tokens, [1, 2, 3, 4, 5], slot=1, ckpt_slot=3, save_id=1)
    gpu_model = HybridModel.from_pretrained(tiny_dir, device="cuda")
    b, _ = _load_into_fresh(gpu_model, store, bs, hashes, hashes[-1], [20, 7, 13, 25, 9], 5, "cuda")
    assert torch.equal(a.cache.recurrent_all[:, 3], b.cache.recurrent_all[:, 5].cpu())
    seq = Seq(2, tokens, [20, 7, 13, 25, 9, 11], 5)
    seq.computed = HIT
    for _ in range(1 + DECODES):
        n_known = len(seq.tokens)
        got = seq.step(b).cpu()
        want = hf_logits(seq.tokens[:n_known])[-1]
        assert (got - want).abs().max().item() < 1e-3
        assert seq.tokens[-1] == int(want.argmax())
