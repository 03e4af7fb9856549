"""Workloads: requests with arrival times, and the built-in multi-turn chat workload."""

from __future__ import annotations

import attrs
import numpy as np

from kvsched.events.types import RequestArrived


@attrs.frozen
class Turn:
    """A request. ``follows`` > 0: a session turn sent ``think_s`` after turn ``follows``
    of the same session finished (a closed loop); otherwise it arrives at ``arrival_s``."""

    request: RequestArrived
    arrival_s: float = 0.0
    follows: int = -1
    think_s: float = 0.0


@attrs.frozen
class Workload:
    name: str
    turns: tuple[Turn, ...]


def chat_workload(
    *,
    sessions: int = 64,
    turns: int = 4,
    system_tokens: int = 512,
    user_tokens: tuple[int, int] = (32, 512),
    output_tokens: tuple[int, int] = (16, 256),
    rate_per_s: float = 20.0,
    think_s: float = 2.0,
    vocab_size: int = 32000,
    seed: int = 0,
) -> Workload:
    """Chat sessions sharing a system prompt; each later turn continues its session."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, vocab_size, system_tokens, dtype=np.int32)
    out: list[Turn] = []
    start = 0.0
    next_id = 0
    for session in range(sessions):
        start += float(rng.exponential(1.0 / rate_per_s))
        prev = -1
        for turn in range(turns):
            n_user = int(rng.integers(user_tokens[0], user_tokens[1] + 1))
            user = rng.integers(1, vocab_size, n_user, dtype=np.int32)
            prompt = np.concatenate([system, user]) if turn == 0 else user
            req = RequestArrived(
                seq_id=next_id,
                prompt=prompt,
                max_tokens=int(rng.integers(output_tokens[0], output_tokens[1] + 1)),
                arrival_time=0.0,
                session_id=session,
            )
            if turn == 0:
                out.append(Turn(req, arrival_s=start))
            else:
                out.append(Turn(req, follows=prev, think_s=think_s))
            prev = next_id
            next_id += 1
    return Workload("chat", tuple(out))


def speed_up(workload: Workload, factor: float) -> Workload:
    """The same requests arriving ``factor`` times faster (open-loop arrival times divided by
    ``factor``; closed-loop think times too)."""
    turns = tuple(
        attrs.evolve(t, arrival_s=t.arrival_s / factor, think_s=t.think_s / factor)
        for t in workload.turns
    )
    return Workload(f"{workload.name} x{factor:g}", turns)
