"""Traffic shapes built in: a generated branching multi-turn chat workload, the parameters of
shapes (``--shape-param K=V,...``) and the sequential ideal of any workload's prompts.

``gen:chat-branching`` (``chat_branching``) is a seeded, open-loop workload of chat
conversations as a stateless chat API sees them: every request carries the whole history
(system prompt, earlier user turns and assistant answers, the new user turn). Conversations
start as a Poisson process, some of them in bursts that arrive at the same instant; each picks
one of a few system prompts by a Zipf popularity; a later turn arrives after the previous
answer's estimated duration plus a think time; and a turn may branch: the user regenerates or
edits an earlier turn, so the new prompt shares the history up to that turn boundary and
diverges there, and the conversation goes on from the new branch. Every parameter and where
its value comes from: ``ChatBranching`` (and docs/replay.md). The same seed gives the same
workload, token for token; turns are open loop (each has its arrival time), so the oracle's
recorded future (``replay/future.py``) applies.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import attrs
import numpy as np

from kvsched.events.types import RequestArrived
from kvsched.replay.workload import Turn, Workload

GENERATED = ("chat-branching",)
"""The built-in generated shapes: ``kvsched replay gen:NAME``."""


class ShapeError(ValueError):
    """A shape parameter that is unknown or out of range; the message names it."""


@attrs.frozen
class ChatBranching:
    """The parameters of ``gen:chat-branching``. None of them was tuned on a replay: each is a
    published statistic of chat traffic or a stated round value (see each comment)."""

    # 1,000 conversations give about 2,000 requests (mean turns 2.0): a whole sweep point
    # replays in seconds to a minute here; a round size, not a statistic.
    conversations: int = 1000
    # "A few system prompts": 8 applications / personas; a round value.
    system_prompts: int = 8
    # Their popularity: Zipf with exponent 1.0, the usual model of content popularity
    # (Breslau et al., INFOCOM'99, web requests: exponents 0.64-0.83; 1.0 is the textbook
    # default); the most popular prompt gets 37 % of conversations with 8 prompts.
    system_zipf: float = 1.0
    # System prompt lengths, uniform in [min, max] tokens: a short persona to a long
    # instruction set; round values (no public distribution found).
    system_tokens_min: int = 256
    system_tokens_max: int = 2048
    # Turns per conversation (branches included): geometric with this mean; LMSYS-Chat-1M
    # (Zheng et al., ICLR'24, arXiv 2309.11998, Table 1) reports 2.0 turns per conversation.
    turns_mean: float = 2.0
    # Tokens of a user turn and of an answer: lognormal with these means and sigma 1.0
    # (heavy-tailed); means from LMSYS-Chat-1M, Table 1: 69.5 per prompt, 214.5 per response.
    user_tokens_mean: float = 69.5
    answer_tokens_mean: float = 214.5
    length_sigma: float = 1.0
    # A later turn is a branch (regenerate or edit an earlier turn) with this probability; no
    # published rate was found: a round value, swept by --shape-param where it matters.
    branch_p: float = 0.15
    # Of the branches, this share regenerates (the same user turn again); the rest edit it.
    regenerate_p: float = 0.5
    # Conversation starts per second (Poisson); at ~2 requests per conversation this is
    # about 4 requests/s, the Mooncake trace's rate (3,993 requests over 1,022 s).
    rate_per_s: float = 2.0
    # A share of starts arrive in bursts of simultaneous conversations (the Azure traces are
    # "very bursty", ../shared/traces/README.md; BurstGPT, Wang et al. 2024, arXiv
    # 2401.17644); the share and the size are round values.
    burst_p: float = 0.2
    burst_size: int = 8
    # Between turns: the answer's duration (its tokens x this time per output token, a
    # typical decode speed of 40 tokens/s) plus the user's think time, exponential with this
    # mean (round value; no public think-time distribution found).
    tpot_s: float = 0.025
    think_mean_s: float = 20.0
    vocab_size: int = 150_000

    def check(self) -> None:
        """ShapeError naming the first parameter out of range."""
        for name in ("conversations", "system_prompts", "burst_size", "system_tokens_min"):
            if getattr(self, name) < 1:
                raise ShapeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_tokens_max < self.system_tokens_min:
            raise ShapeError("system_tokens_max must be >= system_tokens_min")
        for name in ("branch_p", "regenerate_p", "burst_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ShapeError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.turns_mean < 1:
            raise ShapeError(f"turns_mean must be >= 1, got {self.turns_mean}")
        for name in ("user_tokens_mean", "answer_tokens_mean", "rate_per_s"):
            if not getattr(self, name) > 0:
                raise ShapeError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.vocab_size < 2 or self.length_sigma < 0 or self.tpot_s < 0:
            raise ShapeError("vocab_size must be >= 2, length_sigma and tpot_s >= 0")
        if self.think_mean_s < 0:
            raise ShapeError(f"think_mean_s must be >= 0, got {self.think_mean_s}")


def parse_params(cls: type[Any], spec: str | None, **fixed: Any) -> Any:
    """``cls`` (an attrs class of parameters) with the ``K=V,...`` of ``spec`` set (each
    value read as its field's type) and ``fixed`` fields; ShapeError names a bad one."""
    fields = {f.name: f for f in attrs.fields(cls)}
    values: dict[str, Any] = dict(fixed)
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields or key in fixed:
            known = ", ".join(n for n in fields if n not in fixed)
            raise ShapeError(f"{item!r}: not a parameter of {cls.__name__} (known: {known})")
        kind = type(fields[key].default)
        try:
            values[key] = kind(raw.strip())
        except ValueError:
            raise ShapeError(f"{key}={raw!r}: not a {kind.__name__}") from None
    params = cls(**values)
    params.check()
    return params


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> int:
    """A positive token count, lognormal with the given mean (not median) and sigma."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, round(float(rng.lognormal(mu, sigma))))


def _starts(p: ChatBranching, rng: np.random.Generator) -> list[float]:
    """Conversation start times: Poisson arrivals, a share of them bursts of ``burst_size``
    conversations at the same instant."""
    out: list[float] = []
    t = 0.0
    while len(out) < p.conversations:
        t += float(rng.exponential(1.0 / p.rate_per_s))
        n = p.burst_size if rng.random() < p.burst_p else 1
        out.extend([t] * min(n, p.conversations - len(out)))
    return out


def chat_branching(p: ChatBranching, seed: int = 0) -> Workload:
    """The ``gen:chat-branching`` workload of ``p`` (open loop, ids in arrival order)."""
    rng = np.random.default_rng([seed, 0xC4A7])
    ranks = np.arange(1, p.system_prompts + 1, dtype=np.float64) ** -p.system_zipf
    lengths = rng.integers(p.system_tokens_min, p.system_tokens_max + 1, p.system_prompts)
    systems = [rng.integers(1, p.vocab_size, int(n), dtype=np.int32) for n in lengths]
    rows: list[tuple[float, int, np.ndarray, int]] = []
    for c, start in enumerate(_starts(p, rng)):
        system = systems[int(rng.choice(p.system_prompts, p=ranks / ranks.sum()))]
        turns = int(rng.geometric(1.0 / p.turns_mean))
        rows.extend(_conversation(p, rng, system, start, c, turns))
    rows.sort(key=lambda r: (r[0], r[1]))
    out = tuple(
        Turn(RequestArrived(i, prompt, n_out), arrival_s=at)
        for i, (at, _, prompt, n_out) in enumerate(rows)
    )
    return Workload(f"gen:chat-branching seed {seed}", out)


def _conversation(
    p: ChatBranching,
    rng: np.random.Generator,
    system: np.ndarray,
    start: float,
    index: int,
    turns: int,
) -> list[tuple[float, int, np.ndarray, int]]:
    """One conversation's requests as (arrival, order key, prompt, output tokens): each
    prompt is the system prompt, the history so far and the new user turn."""
    history: list[tuple[np.ndarray, np.ndarray]] = []  # (user turn, answer) pairs
    out: list[tuple[float, int, np.ndarray, int]] = []
    t = start
    for k in range(turns):
        user = None
        if history and rng.random() < p.branch_p:
            j = int(rng.integers(0, len(history)))  # the turn boundary it diverges at
            if rng.random() < p.regenerate_p:
                user = history[j][0]
            del history[j:]
        if user is None:
            n = _lognormal(rng, p.user_tokens_mean, p.length_sigma)
            user = rng.integers(1, p.vocab_size, n, dtype=np.int32)
        n_out = _lognormal(rng, p.answer_tokens_mean, p.length_sigma)
        prompt = np.concatenate([system, *(x for pair in history for x in pair), user])
        out.append((t, index * 4096 + k, prompt, n_out))
        history.append((user, rng.integers(1, p.vocab_size, n_out, dtype=np.int32)))
        think = float(rng.exponential(p.think_mean_s)) if p.think_mean_s else 0.0
        t += n_out * p.tpot_s + think
    return out


def generated(name: str, spec: str | None, seed: int, vocab_size: int) -> Workload:
    """The built-in shape ``name`` (one of ``GENERATED``) with the parameters of ``spec``."""
    if name != "chat-branching":
        raise ShapeError(f"gen:{name}: no such generated shape (known: {', '.join(GENERATED)})")
    return chat_branching(parse_params(ChatBranching, spec, vocab_size=vocab_size), seed)


def block_names(prompt: np.ndarray, block_size: int) -> list[bytes]:
    """The names of a prompt's whole blocks: a digest of each block's tokens and its parent's
    name, so equal names mean equal prefixes."""
    raw = np.ascontiguousarray(prompt, dtype=np.int32).tobytes()
    names, parent = [], b""
    for i in range(len(prompt) // block_size):
        parent = hashlib.blake2b(
            parent + raw[4 * i * block_size : 4 * (i + 1) * block_size], digest_size=16
        ).digest()
        names.append(parent)
    return names


def token_ideal(prompts: list[np.ndarray], block_size: int) -> float:
    """Token hit rate with an infinite cache, one request at a time, in arrival order: each
    prompt hits the longest run of whole blocks an earlier prompt began with, never its last
    token (the definition of ``synth.sequential_ideal``, on tokens instead of hash ids)."""
    seen: set[bytes] = set()
    hit = total = 0
    for prompt in prompts:
        n = len(prompt)
        names = block_names(prompt, block_size)
        k, limit = 0, min(len(names), (n - 1) // block_size)
        while k < limit and names[k] in seen:
            k += 1
        hit += k * block_size
        total += n
        seen.update(names)
    return hit / total if total else 0.0
