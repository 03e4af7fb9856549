"""The workload ``kvsched.integrations.vllm.cluster --compare`` and the router tests send
through a router: shared prefixes computed on a known server, then multi-turn sessions, one
request at a time, with where each request went and what it hit (``Routed``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsched.integrations.vllm.cluster import Cluster, answer_ids, complete, vocabulary


@dataclass(frozen=True)
class Routed:
    """One request of a workload: the server holding its longest cached prefix when it was
    sent (None: none does) and how many of its tokens that server holds at least (whole
    blocks), the server it reached and its prefix-cache hit tokens there."""

    name: str
    holder: int | None
    held: int
    reached: int
    hits: float


def tokens(n: int, seed: int, vocab: int = 500) -> list[int]:
    """``n`` pseudo-random token ids in [3, vocab) (no numpy: a linear congruence)."""
    out, x = [], seed * 2654435761 + 12345
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(3 + (x >> 33) % (vocab - 3))
    return out


def shared_prefix_prompts(
    block_size: int, seed: int, prefixes: int = 3, followers: int = 3
) -> list[tuple[str, list[int]]]:
    """The prompts of ``shared_prefixes``, named: per prefix ``p`` (4 blocks) first
    ``prefix{p}-seed`` (the prefix and 8 tokens), then ``prefix{p}-{f}`` for each follower
    (the prefix and a 1-block tail of its own)."""
    bs, out = block_size, []
    for p in range(prefixes):
        prefix = tokens(4 * bs, seed * 1000 + p)
        out.append((f"prefix{p}-seed", prefix + tokens(8, seed * 1000 + 500 + p)))
        for f in range(followers):
            out.append((f"prefix{p}-{f}", prefix + tokens(bs, seed * 1000 + 100 * p + f)))
    return out


def shared_prefixes(
    cluster: Cluster, router_url: str, seed: int, prefixes: int = 3, followers: int = 3
) -> list[Routed]:
    """Prefix ``p``'s seed request (``shared_prefix_prompts``) is computed on server
    ``p % n`` directly; then its ``followers`` go through the router, one prefix after
    another."""
    n, out = len(cluster.engines), []
    prefix_len = 4 * cluster.block_size
    for name, prompt in shared_prefix_prompts(cluster.block_size, seed, prefixes, followers):
        p = int(name[len("prefix") : name.index("-")])
        if name.endswith("-seed"):
            complete(cluster.engines[p % n].url, cluster.model, prompt)
            continue
        before = cluster.counters()
        reached, _ = cluster.send(router_url, prompt)
        hits = cluster.hits_since(reached, before)
        out.append(Routed(name, p % n, prefix_len, reached, hits))
    return out


def sessions(
    cluster: Cluster, router_url: str, seed: int, count: int = 2, turns: int = 3
) -> list[Routed]:
    """Multi-turn sessions through the router: turn ``t + 1`` is turn ``t``'s prompt, its
    answer and a new 1-block message, so it shares all of turn ``t`` with the server that
    served it (which holds at least turn ``t``'s prompt, in whole blocks)."""
    bs, out, vocab = cluster.block_size, [], vocabulary(cluster.model)
    for s in range(count):
        prompt, holder, held = tokens(2 * bs, seed * 1000 + 700 + s), None, 0
        for t in range(turns):
            before = cluster.counters()
            reached, response = cluster.send(router_url, prompt, max_tokens=8)
            hits = cluster.hits_since(reached, before)
            out.append(Routed(f"session{s}-turn{t}", holder, held, reached, hits))
            holder, held = reached, len(prompt) // bs * bs
            prompt = prompt + answer_ids(response, vocab) + tokens(bs, seed * 1000 + 800 + t)
    return out


def workload(cluster: Cluster, router_url: str, seed: int) -> list[Routed]:
    """Shared prefixes, then multi-turn sessions (every prompt is new to this cluster for a
    new ``seed``)."""
    return shared_prefixes(cluster, router_url, seed) + sessions(cluster, router_url, seed)


def summary(routed: Sequence[Routed]) -> dict[str, Any]:
    held = [r for r in routed if r.holder is not None]
    return {
        "requests": len(routed),
        "to_holder": sum(r.reached == r.holder for r in held),
        "with_holder": len(held),
        "hit_tokens": sum(r.hits for r in routed),
        "reached": [r.reached for r in routed],
    }
