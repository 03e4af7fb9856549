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
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                run()
                dt = time.perf_counter() - t0
            finally:
                gc.enable()
            undo()
            if i >= warmup:
                times.append(dt * 1e3)
    finally:
        if freeze:
            gc.unfreeze()
    return np.asarray(times)


def summarize(times_ms: np.ndarray) -> dict[str, float]:
    return {
        "p50_ms": round(float(np.percentile(times_ms, 50)), 3),
        "p99_ms": round(float(np.percentile(times_ms, 99)), 3),
        "min_ms": round(float(times_ms.min()), 3),
    }
