"""``kvsched bench identity``: the block identity of one prompt, beside one memory pass.

Times ``identity.chain_packed`` (what a request's arrival computes: the digests of all its
full blocks from the namespace root, one native call for ``kvs128``) on a prompt of L random
token ids (int32, ``default_rng(0).integers(1, 150000)``, as ``bench match``), and in the same
run ``numpy.array_equal`` of those tokens against a copy: one pass over the same memory, the
floor any exact comparison (lmdeploy's verification reads every token) pays. Each call is
timed alone (``perf_counter`` around it); p50 / p99 over ``samples`` calls after ``warmup``,
the two alternating call by call, the garbage collector paused for the run (a collection
between calls, as ``stats.time_samples`` runs, would also evict the tokens from the caches:
a request's tokens are in cache when it arrives, its bytes just decoded).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvsched.bench.match import VOCAB
from kvsched.bench.stats import summarize
from kvsched.config import IDENTITY_SCHEMES, ModelSpec
from kvsched.identity import chain_packed, namespace_root


def run_identity_bench(
    *,
    context: int,
    block_size: int = 64,
    scheme: str = "kvs128",
    warmup: int = 20,
    samples: int = 500,
) -> dict[str, Any]:
    if scheme not in IDENTITY_SCHEMES:
        raise ValueError(f"unknown identity scheme {scheme!r}; known: {IDENTITY_SCHEMES}")
    tokens = np.random.default_rng(0).integers(1, VOCAB, size=context).astype(np.int32)
    copy = tokens.copy()
    root = namespace_root(ModelSpec(), block_size, scheme=scheme)

    def identity() -> None:
        chain_packed(scheme, root, root, tokens, block_size)

    def one_pass() -> None:
        np.array_equal(tokens, copy)

    times = _alternating((identity, one_pass), warmup, samples)
    ident, scan = summarize(times[0]), summarize(times[1])
    return {
        "impl": "kvsched",
        "bench": "identity",
        "scheme": scheme,
        "context": context,
        "block_size": block_size,
        **ident,
        "ns_per_token_p50": round(ident["p50_ms"] * 1e6 / context, 3),
        "array_equal_p50_ms": scan["p50_ms"],
        "array_equal_p99_ms": scan["p99_ms"],
        "ratio_to_array_equal": round(ident["p50_ms"] / max(scan["p50_ms"], 1e-9), 2),
    }


def _alternating(
    calls: tuple[Callable[[], None], ...], warmup: int, samples: int
) -> list[np.ndarray]:
    """Milliseconds of each call, the calls alternating, GC paused throughout."""
    out: list[list[float]] = [[] for _ in calls]
    gc.collect()
    gc.disable()
    try:
        for i in range(warmup + samples):
            for fn, times in zip(calls, out, strict=True):
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    times.append(dt * 1e3)
    finally:
        gc.enable()
    return [np.asarray(t) for t in out]
