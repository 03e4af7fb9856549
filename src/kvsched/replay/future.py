"""The recorded future of a trace, for the "oracle" checkpoint rules (an upper reference).

Under the oracle (``reducers.future.reads_future``) the replay driver writes onto every
arrival the depths where its state will be reused (``RequestArrived.reuse``): the engine folds
them as input, so the log holds them and ``kvsched verify`` replays the same decisions. Under
any other rules it strips a recorded future (a trace read from an oracle run's log).

What is recorded: in arrival order, request ``j``'s hit ends at ``t_j`` blocks, the longest
prefix of its full-block digest chain that an earlier request's prompt holds (a trie over
block-hash chains: a chain digest names its whole prefix, so the set of digests seen is the
trie), capped at the deepest block a hit may restore (a hit never covers the prompt's last
token). Request ``i`` then gets, for each depth ``d`` of its chain, the first later request
``j > i`` whose hit ends at ``d`` blocks on the same prefix: ``(d x block size, j)``. Only
prompts count (generated outputs are the executor's, unknown before the run). The future of
an open loop only: a session turn arrives when its previous turn ends and continues its
output, so a workload with session turns (``kvsched demo``'s chat) is refused.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import pairwise

import attrs
import msgspec

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.identity import DIGEST_SIZE, chain_packed, namespace_root, span_extras
from kvsched.reducers.future import reads_future
from kvsched.replay.setup import SetupError
from kvsched.replay.workload import Workload

__all__ = ["future_for", "hit_ends", "reuse_pairs", "with_future", "without_future"]


def future_for(config: SchedulerConfig, workload: Workload) -> Workload:
    """The workload as ``config``'s engine takes it: with the recorded future under the
    oracle, without one otherwise."""
    if reads_future(config):
        return with_future(workload, config)
    return without_future(workload)


def without_future(workload: Workload) -> Workload:
    """The workload with no recorded future (itself when none is recorded)."""
    if not any(t.request.reuse for t in workload.turns):
        return workload
    turns = tuple(attrs.evolve(t, request=_with_reuse(t.request, ())) for t in workload.turns)
    return Workload(workload.name, turns)


def with_future(workload: Workload, config: SchedulerConfig) -> Workload:
    """Each arrival with its recorded future (``reuse_pairs``); SetupError for a workload
    whose future depends on the run (session turns) or whose ids are not in arrival order."""
    for t in workload.turns:
        if t.follows >= 0 or t.request.session_id >= 0:
            raise SetupError(
                "checkpoint policy 'oracle' needs a trace's future: a session turn "
                f"(request {t.request.seq_id}) arrives when its previous turn ends and "
                "continues its output, unknown before the run"
            )
    ordered = sorted(workload.turns, key=lambda t: (t.arrival_s, t.request.seq_id))
    ids = [t.request.seq_id for t in ordered]
    if any(b <= a for a, b in pairwise(ids)):
        raise SetupError(
            "checkpoint policy 'oracle' compares request ids as arrival order: number the "
            "requests in arrival order"
        )
    chains = [_chain(config, t.request) for t in ordered]
    bs = config.block_size
    tails = [(len(t.request.prompt) - 1) // bs for t in ordered]
    pairs = reuse_pairs(ids, chains, tails, bs)
    by_id = dict(zip(ids, pairs, strict=True))
    turns = tuple(
        attrs.evolve(t, request=_with_reuse(t.request, by_id[t.request.seq_id]))
        for t in workload.turns
    )
    return Workload(workload.name, turns)


def hit_ends(chains: list[list[bytes]], tails: list[int]) -> list[int]:
    """Per request, in arrival order: the blocks its hit ends at, the longest prefix of its
    chain an earlier request holds, at most ``tails[j]`` blocks."""
    seen: set[bytes] = set()
    out: list[int] = []
    for chain, tail in zip(chains, tails, strict=True):
        k, limit = 0, min(len(chain), tail)
        while k < limit and chain[k] in seen:
            k += 1
        out.append(k)
        seen.update(chain)
    return out


def reuse_pairs(
    ids: list[int], chains: list[list[bytes]], tails: list[int], bs: int
) -> list[tuple[tuple[int, int], ...]]:
    """Per request, in arrival order (``ids`` ascending): its (depth in tokens, next user)
    pairs, depths ascending: the first later request whose hit ends there on its prefix."""
    users: dict[bytes, list[int]] = {}  # the digest where a hit ends -> its users, in order
    for seq_id, chain, end in zip(ids, chains, hit_ends(chains, tails), strict=True):
        if end:
            users.setdefault(chain[end - 1], []).append(seq_id)
    out: list[tuple[tuple[int, int], ...]] = []
    for seq_id, chain in zip(ids, chains, strict=True):
        pairs: list[tuple[int, int]] = []
        for depth, digest in enumerate(chain, 1):
            later = users.get(digest)
            if later:
                i = bisect_right(later, seq_id)
                if i < len(later):
                    pairs.append((depth * bs, later[i]))
        out.append(tuple(pairs))
    return out


def _chain(config: SchedulerConfig, e: ev.RequestArrived) -> list[bytes]:
    """The digests of a request's full prompt blocks (its namespace and spans included)."""
    bs, scheme = config.block_size, config.identity
    root = namespace_root(config.model, bs, e.adapter, e.cache_salt, scheme)
    extras = span_extras(e.mm_spans, bs, 0, len(e.prompt) // bs) if e.mm_spans else None
    packed = chain_packed(scheme, root, root, e.prompt, bs, 0, extras)
    return [packed[i : i + DIGEST_SIZE] for i in range(0, len(packed), DIGEST_SIZE)]


def _with_reuse(e: ev.RequestArrived, reuse: tuple[tuple[int, int], ...]) -> ev.RequestArrived:
    return msgspec.structs.replace(e, reuse=reuse)
