"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np


def time_samples(
    run: Callable[[], None],
    undo: Callable[[], None],
    warmup: int,
    samples: int,
    *,
    freeze: bool = False,
) -> np.ndarray:
    """Milliseconds of ``run`` over ``warmup + samples`` calls (warm-ups dropped); ``undo``
    runs untimed after each call. The garbage collector is run before and paused during each
    timed call. With ``freeze`` the objects alive before the first call (the benchmark's
    set-up) are frozen (``gc.freeze``) for the duration, so that the collection before each
    call only traverses what the calls created: a full collection over a large set-up takes
    tens of milliseconds (untimed, but the user waits for it) and leaves the caches cold for
    the call it precedes."""
    times: list[float] = []
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        for i in range(warmup + samples):
            ms = time_call(run)
            undo()
            if i >= warmup:
                times.append(ms)
    finally:
        if freeze:
            gc.unfreeze()
    return np.asarray(times)


def time_call(run: Callable[[], None]) -> float:
    """Milliseconds of one call of ``run``: the garbage collector is run before it and paused
    during it (one sample of ``time_samples``)."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
    return dt * 1e3


class Sampler:
    """A benchmark whose samples can be driven one at a time from outside (another process's
    samples interleaved with them): the set-up is done by the constructor (untimed, its
    seconds in ``build_s``), ``run`` is the timed scope, ``undo`` restores the state after it
    (untimed)."""

    build_s: float = 0.0

    def run(self) -> None:
        raise NotImplementedError

    def undo(self) -> None:
        raise NotImplementedError

    def sample(self) -> float:
        """Milliseconds of one timed ``run`` (``time_call``), then the untimed ``undo``."""
        ms = time_call(self.run)
        self.undo()
        return ms

    def samples(self, warmup: int, samples: int) -> np.ndarray:
        return time_samples(self.run, self.undo, warmup, samples)


def interleave(
    first: Callable[[], float], second: Callable[[], float], warmup: int, samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """Samples of two benchmarks taken in pairs, so that both see the same machine: iteration
    ``i`` takes one sample of each, ``first`` then ``second`` when ``i`` is even and the other
    way round when it is odd (A B, B A, ...: neither is always the one that runs first). The
    first ``warmup`` iterations are dropped. Returns both sides' milliseconds, pair by pair."""
    a: list[float] = []
    b: list[float] = []
    for i in range(warmup + samples):
        if i % 2 == 0:
            x = first()
            y = second()
        else:
            y = second()
            x = first()
        if i >= warmup:
            a.append(x)
            b.append(y)
    return np.asarray(a), np.asarray(b)


def paired_ratios(base_ms: np.ndarray, other_ms: np.ndarray) -> dict[str, float]:
    """How many times slower ``other`` is than ``base`` (above 1: ``base`` is faster), from
    samples taken in pairs (``interleave``): ``ratio_p50`` is the ratio of the two medians,
    ``ratio_pairs_p50`` the median of the pairs' own ratios (each pair saw the same machine,
    so the drift of the machine's speed between pairs cancels out of it)."""
    base = np.asarray(base_ms, dtype=float)
    other = np.asarray(other_ms, dtype=float)
    if base.shape != other.shape or base.ndim != 1 or not len(base):
        raise ValueError("paired samples: two equally long, non-empty series")
    return {
        "ratio_p50": round(float(np.median(other) / np.median(base)), 3),
        "ratio_pairs_p50": round(float(np.median(other / base)), 3),
    }


def summarize(times_ms: np.ndarray) -> dict[str, float]:
    return {
        "p50_ms": round(float(np.percentile(times_ms, 50)), 3),
        "p99_ms": round(float(np.percentile(times_ms, 99)), 3),
        "min_ms": round(float(times_ms.min()), 3),
    }
