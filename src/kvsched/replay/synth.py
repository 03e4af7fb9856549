"""Mooncake's prompt tokens, synthesised: each hash id stands for a 512-token block, and token
j of id x is a function of (seed, x, j) only (a counter-based PRNG), so two requests share
exactly the prompt prefix their ids share (``traces.py`` reads the trace)."""

from __future__ import annotations

import numpy as np

MOONCAKE_BLOCK = 512


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (vectorised, wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def synth_tokens(keys: np.ndarray, length: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """``length`` tokens for each key (shape [len(keys), length]), in [1, vocab_size).

    Token j of key x depends on (seed, x, j) only: a counter-based PRNG seeded with x.
    """
    with np.errstate(over="ignore"):
        base = _mix(keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed))
        counter = np.arange(length, dtype=np.uint64)
        raw = _mix(base[:, None] + counter[None, :] * np.uint64(0xD1B54A32D192ED03))
    out: np.ndarray = (raw % np.uint64(vocab_size - 1) + np.uint64(1)).astype(np.int32)
    return out


class BlockTokens:
    """The 512 tokens of each hash id that occurs, synthesised on its first use: memory
    follows the ids a trace uses, whatever their values (token j of id x is the same as in
    a table of every id up to x)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.blocks: dict[int, np.ndarray] = {}

    def prompt(self, ids: list[int], n_in: int) -> np.ndarray:
        missing = [x for x in dict.fromkeys(ids) if x not in self.blocks]
        if missing:
            keys = np.asarray(missing, dtype=np.uint64)
            fresh = synth_tokens(keys, MOONCAKE_BLOCK, self.vocab_size, self.seed)
            self.blocks.update(zip(missing, fresh, strict=True))
        parts = [self.blocks[x] for x in ids]
        parts[-1] = parts[-1][: n_in - (len(ids) - 1) * MOONCAKE_BLOCK]
        return np.concatenate(parts)


def sequential_ideal(
    ids_per_request: list[list[int]], lengths: list[int], block_size: int
) -> float:
    """Token hit rate with an infinite cache and one request at a time: each request hits the
    longest prefix of blocks seen in any earlier request, whole scheduler blocks only, never
    its last token."""
    seen: set[int] = set()
    hit = total = 0
    for ids, n_in in zip(ids_per_request, lengths, strict=True):
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        tokens = min(k * MOONCAKE_BLOCK, n_in)
        hit += min(tokens // block_size, (n_in - 1) // block_size) * block_size
        total += n_in
        seen.update(ids)
    return hit / total if total else 0.0
