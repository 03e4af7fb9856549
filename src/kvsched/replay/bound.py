"""What an online checkpoint policy can know about a trace (issue 26 item 5).

A hybrid hit needs a recurrent state saved exactly where the hit ends. Each hit of the
trace's sequential ideal (``shapes.token_ideal``: infinite cache, one request at a time)
falls in two parts:

- **known**: up to the deepest point on the prompt's path where an *earlier* request's hit
  already ended (a branch point). A policy learns these points from the past alone, so it can
  save them exactly; it still has to keep them until their last use.
- **speculative**: the rest, from there to where the hit ends. The state that serves it had
  to be saved by the request that computed that prefix (the producer), before anyone shared
  it, at a point no request had yet picked out, and then kept through every request that
  arrived in between. ``within`` says how much of it a policy could serve if it kept every
  producer's right state for ``W`` requests.

``live_peak`` / ``live_mean``: how many branch points are alive at once (from the request
that first shares a prefix to the last one that restores it): the states the known part needs
even with a perfect knowledge of when each one dies.

Prompts must be whole (a session turn's full context), in arrival order: generated shapes and
trace files are; the closed-loop chat demo is not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import attrs
import numpy as np

from kvsched.replay.shapes import block_names
from kvsched.replay.traces import Trace, TraceError

WINDOWS = (64, 128, 256, 512, 1024)


@attrs.frozen
class ReuseBound:
    """Token hit rates (fractions of all prompt tokens) of a trace's sequential ideal."""

    requests: int
    ideal: float
    known: float
    speculative: float
    within: tuple[tuple[int, float], ...]  # (W requests, speculative hits made <= W before)
    live_peak: int
    live_mean: float
    producers: int  # requests whose prefix a speculative hit ends in


@attrs.define
class _Walk:
    """The fold over prompts in arrival order (one owner of the running sets)."""

    block_size: int
    made: dict[bytes, int] = attrs.field(factory=dict)  # block name -> producer request
    hit_ends: dict[bytes, list[int]] = attrs.field(factory=dict)  # name -> requests ending there
    known: int = 0
    total: int = 0
    spec: list[tuple[int, int]] = attrs.field(factory=list)  # (gap in requests, tokens)
    producers: set[int] = attrs.field(factory=set)  # requests a speculative hit's state is of

    def add(self, index: int, prompt: np.ndarray) -> None:
        names = block_names(prompt, self.block_size)
        limit = min(len(names), (len(prompt) - 1) // self.block_size)
        k = 0
        while k < limit and names[k] in self.made:
            k += 1
        self.total += len(prompt)
        if k:
            j = max((d for d in range(1, k + 1) if names[d - 1] in self.hit_ends), default=0)
            self.known += j * self.block_size
            if k > j:
                producer = self.made[names[k - 1]]
                self.spec.append((index - producer, (k - j) * self.block_size))
                self.producers.add(producer)
            self.hit_ends.setdefault(names[k - 1], []).append(index)
        for name in names:
            self.made.setdefault(name, index)

    def live(self, requests: int) -> tuple[int, float]:
        """Peak and mean number of hit ends restored more than once, alive between their
        first and last use."""
        change = np.zeros(requests + 1, dtype=np.int64)
        for uses in self.hit_ends.values():
            if len(uses) > 1:
                change[uses[0]] += 1
                change[uses[-1]] -= 1
        alive = np.cumsum(change)[:requests]
        return (int(alive.max()), float(alive.mean())) if requests else (0, 0.0)


def reuse_bound(
    prompts: Sequence[np.ndarray], block_size: int, windows: Sequence[int] = WINDOWS
) -> ReuseBound:
    """The known / speculative split of ``prompts``' sequential ideal at ``block_size``."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, not {block_size}")
    walk = _Walk(block_size)
    for index, prompt in enumerate(prompts):
        walk.add(index, prompt)
    total = walk.total or 1
    gaps = np.array([g for g, _ in walk.spec], dtype=np.int64)
    tokens = np.array([t for _, t in walk.spec], dtype=np.int64)
    spec = int(tokens.sum())
    within = tuple((w, int(tokens[gaps <= w].sum()) / total) for w in windows)
    peak, mean = walk.live(len(prompts))
    return ReuseBound(
        len(prompts),
        (walk.known + spec) / total,
        walk.known / total,
        spec / total,
        within,
        peak,
        mean,
        len(walk.producers),
    )


def trace_prompts(trace: Trace) -> list[np.ndarray]:
    """The prompts of a trace's requests in arrival order."""
    turns = sorted(enumerate(trace.workload.turns), key=lambda it: (it[1].arrival_s, it[0]))
    if any(t.follows >= 0 for _, t in turns):
        raise TraceError(f"{trace.info.path}: closed-loop turns carry only their new tokens")
    return [t.request.prompt for _, t in turns]


def format_bound(name: str, bound: ReuseBound) -> str:
    rows = [
        f"{name}: {bound.requests:,} requests",
        f"  ideal hit rate        {100 * bound.ideal:6.2f} %",
        f"  known (branch points) {100 * bound.known:6.2f} %",
        f"  speculative           {100 * bound.speculative:6.2f} %",
    ]
    rows += [f"    made <= {w:>5} requests before {100 * v:6.2f} %" for w, v in bound.within]
    rows.append(f"  requests that produced a speculative hit: {bound.producers:,}")
    rows.append(
        f"  branch points alive at once: peak {bound.live_peak}, mean {bound.live_mean:.1f}"
    )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvsched.replay.bound",
        description="Split a trace's ideal hits into known and speculative parts.",
    )
    parser.add_argument("trace", help="a trace file or gen:chat-branching")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--sharing", default=None, help="Azure traces: a sharing model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from kvsched.replay.setup import load_trace_replay

    try:
        setup = load_trace_replay(
            args.trace, block_size=args.block_size, seed=args.seed, sharing=args.sharing
        )
        bound = reuse_bound(trace_prompts(setup.trace), args.block_size)
    except (TraceError, ValueError, OSError) as exc:  # (SetupError is a ValueError)
        print(f"kvsched: error: {exc}", file=sys.stderr)
        return 2
    print(format_bound(args.trace, bound))
    return 0


if __name__ == "__main__":
    sys.exit(main())
