"""Throughput of the torch executor on the tiny hybrid model, and the saving of a prefix hit.

``run_bench()`` returns a dict:

* ``prefill_tok_s``: one sequence's ``prompt_len``-token prompt, computed in canonical chunks
  of ``chunk`` tokens (one step per chunk);
* ``decode_tok_s``: ``{batch: tokens/s}`` for batches of decoding sequences with
  ``decode_context`` tokens of context each, ``decode_steps`` steps;
* ``hit``: the prompt computed from scratch (``cold_s``) against restoring a state checkpoint
  and the shared KV blocks at ``hit_tokens`` and computing the rest (``warm_s``), with
  ``saving`` = 1 - warm / cold (of the minima) and the median saving of interleaved pairs.

Timings are the minimum over ``repeats`` runs (each on a fresh cache, after one warm-up).
Run as ``python3 -m kvsched.gpu.bench_torch [--json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsched.gpu.config import HybridConfig
from kvsched.gpu.fixtures import TINY_CONFIG
from kvsched.gpu.model import HybridModel, count_parameters
from kvsched.gpu.torch_executor import TorchExecutor
from kvsched.plan import StepPlan


def _ro(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _plan(
    work: Sequence[tuple[int, Sequence[int], int, int, Sequence[int], int]],
    block_size: int,
    *,
    state_restore: Sequence[tuple[int, int]] = (),
) -> StepPlan:
    """A StepPlan for (seq_id, tokens, start, end, blocks, slot) items, as plan_step builds it."""
    bs = block_size
    starts = np.array([w[2] for w in work], dtype=np.int64)
    ends = np.array([w[3] for w in work], dtype=np.int64)
    lens = ends - starts
    nblocks = -(-ends // bs)
    width = int(nblocks.max())
    tables = np.zeros((len(work), width), dtype=np.int32)
    positions, slots, ids = [], [], []
    for i, (_, tokens, a, b, blocks, _) in enumerate(work):
        blk = np.asarray(blocks, dtype=np.int64)
        tables[i, : nblocks[i]] = blk[: nblocks[i]]
        pos = np.arange(a, b, dtype=np.int64)
        positions.append(pos)
        slots.append(blk[pos // bs] * bs + pos % bs)
        ids.append(np.asarray(tokens[a:b], dtype=np.int32))
    ntokens = np.array([len(w[1]) for w in work], dtype=np.int64)
    decode = (lens == 1) & (starts == ntokens - 1)
    empty2 = _ro(np.zeros((0, 2), dtype=np.int32))
    empty1 = _ro(np.zeros(0, dtype=np.int32))
    return StepPlan(
        step=0,
        clock=0.0,
        block_size=bs,
        seq_ids=_ro(np.array([w[0] for w in work], dtype=np.int64)),
        starts=_ro(starts),
        ends=_ro(ends),
        sample=_ro(ends == ntokens),
        input_ids=_ro(np.concatenate(ids)),
        positions=_ro(np.concatenate(positions)),
        slot_mapping=_ro(np.concatenate(slots)),
        block_tables=_ro(tables),
        num_blocks=_ro(nblocks.astype(np.int32)),
        copy_blocks=empty2,
        zero_blocks=empty1,
        state_slots=_ro(np.array([w[5] for w in work], dtype=np.int32)),
        state_zero=empty1,
        state_restore=_ro(np.asarray(state_restore, dtype=np.int32).reshape(-1, 2)),
        state_save=empty2,
        copy_blocks_after=empty2,
        temperature=_ro(np.zeros(len(work), dtype=np.float32)),
        seeds=_ro(np.zeros(len(work), dtype=np.int64)),
        num_prefill_tokens=int(lens[~decode].sum()),
        num_decode_tokens=int(decode.sum()),
        num_hit_tokens=0,
        num_query_tokens=0,
    )


def _chunks(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    out, a = [], start
    while a < end:
        b = min((a // chunk + 1) * chunk, end)
        out.append((a, b))
        a = b
    return out


def _best(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm-up
    return min(fn() for _ in range(repeats))


def tiny_model(seed: int = 0, device: str | torch.device = "cpu") -> HybridModel:
    """The tiny fixture architecture with seeded random weights (no transformers needed)."""
    torch.manual_seed(seed)
    model = HybridModel(HybridConfig.from_dict(TINY_CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.to(device).eval()


def run_bench(
    model_dir: str | Path | None = None,
    *,
    prompt_len: int = 2048,
    hit_tokens: int = 1024,
    chunk: int = 2048,
    block_size: int = 64,
    decode_batches: Sequence[int] = (1, 8, 32),
    decode_context: int = 128,
    decode_steps: int = 16,
    repeats: int = 3,
    threads: int | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    if threads is not None:
        torch.set_num_threads(threads)
    model = (
        HybridModel.from_pretrained(model_dir, device=device or "cpu")
        if model_dir is not None
        else tiny_model(device=device or "cpu")
    )
    bs = block_size
    max_batch = max(decode_batches)
    need = max(prompt_len, decode_context + decode_steps + 1)
    per_seq = -(-need // bs)
    num_blocks = 1 + per_seq * max(max_batch, 2)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def new_executor() -> TorchExecutor:
        return TorchExecutor(model, num_blocks, bs, 2 + max_batch, device=device)

    prompt = rng.integers(1, vocab, prompt_len).tolist()
    blocks_a = list(range(1, 1 + per_seq))
    blocks_b = blocks_a[: hit_tokens // bs] + list(
        range(1 + per_seq, 1 + per_seq + per_seq - hit_tokens // bs)
    )
    assert hit_tokens % bs == 0, "the hit must be block-aligned"

    def prefill(ex: TorchExecutor, start: int, blocks: list[int], slot: int, **ops: Any) -> float:
        t0 = time.perf_counter()
        for a, b in _chunks(start, prompt_len, chunk):
            ex.execute(_plan([(0, prompt, a, b, blocks, slot)], bs, **ops))
            ops = {}
        return time.perf_counter() - t0

    def cold() -> float:
        return prefill(new_executor(), 0, blocks_a, 1)

    def warm() -> float:
        ex = new_executor()
        # the checkpoint: A's state after hit_tokens, saved to slot 2 + its KV blocks
        ex.execute(_plan([(0, prompt, 0, hit_tokens, blocks_a, 1)], bs))
        ex.cache.copy_states(torch.tensor([[1, 2]], device=ex.device))
        return prefill(ex, hit_tokens, blocks_b, 1, state_restore=[(2, 1)])

    # interleaved pairs: a noisy machine's load drifts less between the two sides of a pair
    cold(), warm()  # warm-up
    pairs = [(cold(), warm()) for _ in range(repeats)]
    cold_s, warm_s = min(c for c, _ in pairs), min(w for _, w in pairs)
    paired_saving = float(np.median([1.0 - w / c for c, w in pairs]))

    decode: dict[int, float] = {}
    for batch in decode_batches:
        seqs = [
            (i, rng.integers(1, vocab, decode_context).tolist(), 1 + i * per_seq)
            for i in range(batch)
        ]

        def run_decode(seqs: list[tuple[int, list[int], int]] = seqs) -> float:
            ex = new_executor()
            toks = [list(t) for _, t, _ in seqs]
            work = [
                (sid, toks[i], 0, len(toks[i]), range(b0, b0 + per_seq), 1 + i)
                for i, (sid, _, b0) in enumerate(seqs)
            ]
            out = ex.execute(_plan(work, bs))
            t0 = time.perf_counter()
            for _ in range(decode_steps):
                for i, tok in enumerate(out.tokens.tolist()):
                    toks[i].append(tok)
                work = [
                    (sid, toks[i], len(toks[i]) - 1, len(toks[i]), range(b0, b0 + per_seq), 1 + i)
                    for i, (sid, _, b0) in enumerate(seqs)
                ]
                out = ex.execute(_plan(work, bs))
            return time.perf_counter() - t0

        decode[batch] = batch * decode_steps / _best(run_decode, repeats)

    return {
        "device": str(new_executor().device),
        "threads": torch.get_num_threads(),
        "params": count_parameters(model),
        "gdn_mode": model.gdn_mode,
        "prompt_len": prompt_len,
        "chunk": chunk,
        "block_size": bs,
        "prefill_tok_s": prompt_len / cold_s,
        "decode_context": decode_context,
        "decode_tok_s": decode,
        "hit": {
            "hit_tokens": hit_tokens,
            "cold_s": cold_s,
            "warm_s": warm_s,
            "saving": 1.0 - warm_s / cold_s,
            "saving_median_of_pairs": paired_saving,
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--hit", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run_bench(
        args.model_dir,
        prompt_len=args.prompt_len,
        hit_tokens=args.hit,
        chunk=args.chunk,
        repeats=args.repeats,
        threads=args.threads,
        device=args.device,
    )
    print(json.dumps(res, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
