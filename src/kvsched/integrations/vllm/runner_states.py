"""``RunnerStates``: the harness's model of where vLLM's GPU model runner keeps a hybrid
model's recurrent states in ``mamba_cache_mode="align"`` (no model, no tensors; needs no vLLM).

vLLM's runner (``v1/worker/mamba_utils.preprocess_mamba``) keeps each request's running
state in a block of its mamba block list: before a forward it copies the state from column
``prev`` (the column it used last step; for a request new to it, ``(num_computed - 1) //
block_size``, the block a prefix hit restores from) to column ``curr = cdiv(num_computed +
scheduled, block_size) - 1``, and the forward updates the state there. Whatever stays in a
block is what a later hit on it restores.

The model holds, per block id of one mamba group, the prefix its state summarises (a digest of
the tokens), and checks before every forward that the state the runner is about to continue
is the one of the request's computed tokens: a hit restored from a block that holds another
prefix's state (or a state overwritten since), or a running state clobbered between steps, is
a wrong answer on a real model, and here an ``AssertionError``.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["RunnerBlocks", "RunnerEncoder", "RunnerStates", "follow_tables", "mamba_group"]


def mamba_group(kv_cache_config: Any) -> tuple[int, int] | None:
    """(group index, block size) of the first mamba group of a ``KVCacheConfig`` (None for an
    attention model)."""
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        if type(group.kv_cache_spec).__name__.endswith("MambaSpec"):
            return g, int(group.kv_cache_spec.block_size)
    return None


def follow_tables(tables: dict[str, list[int]], so: Any, group: int) -> None:
    """Each request's block list of KV cache group ``group`` as the runner holds it, after
    the step ``so``: a new request's whole list, a resumed one's again, blocks appended to
    the others'."""
    cached = so.scheduled_cached_reqs
    for r in so.scheduled_new_reqs:
        tables[r.req_id] = list(r.block_ids[group])
    for name, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if ids is None:
            continue
        if name in cached.resumed_req_ids:
            tables[name] = list(ids[group])
        else:
            tables[name].extend(ids[group])


def digest(tokens: list[int]) -> bytes:
    """The state after ``tokens`` (a stand-in: equal prefixes, equal states)."""
    return hashlib.blake2b(repr(tokens).encode(), digest_size=12).digest()


class RunnerStates:
    def __init__(self, group: int, block_size: int) -> None:
        self.group, self.block_size = group, block_size
        self.tables: dict[str, list[int]] = {}  # each request's mamba block list
        self.column: dict[str, int] = {}  # the runner's mamba_state_idx
        self.blocks: dict[int, bytes] = {}  # block id -> the prefix its state summarises
        self.checked = 0  # forwards that continued a state (a hit or an earlier step)

    def schedule(self, so: Any) -> None:
        """The block lists a step sends, and the runner's clean-up of its state columns."""
        cached = so.scheduled_cached_reqs
        for name in [*so.finished_req_ids, *(so.preempted_req_ids or ()), *cached.resumed_req_ids]:
            self.column.pop(name, None)
        follow_tables(self.tables, so, self.group)

    def forward(self, name: str, start: int, end: int, tokens: list[int]) -> None:
        """The runner computes ``tokens[start:end]`` of ``name`` (``tokens``: every token it
        knows of the request): the state copy before the forward, the check, the write."""
        bs, table = self.block_size, self.tables[name]
        prev = self.column.get(name, (start - 1) // bs)
        curr = -(-end // bs) - 1
        self.column[name] = curr
        if prev != -1 and prev != curr:
            self.blocks[table[curr]] = self.blocks.get(table[prev], b"")
        if start:
            want = digest(tokens[:start])
            if self.blocks.get(table[curr]) != want:
                raise AssertionError(
                    f"request {name}: the runner continues at token {start} from block "
                    f"{table[curr]} (column {curr}), which holds another prefix's state"
                )
            self.checked += 1
        self.blocks[table[curr]] = digest(tokens[:end])


class RunnerBlocks:
    """How many blocks the runner holds per request (an attention model's one group),
    checked against vLLM's ``allocate_slots``: each scheduled request's blocks cover its
    work and the drafter's lookahead slots past it, up to the context (an EAGLE drafter
    writes KV there; a block it lacks would be written through the null block)."""

    def __init__(self, vllm_config: Any) -> None:
        self.slots = int(vllm_config.num_lookahead_tokens)
        self.limit = int(vllm_config.model_config.max_model_len)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tables: dict[str, list[int]] = {}

    def step(self, so: Any, computed: dict[str, int]) -> None:
        """The block lists a step sends; then the check (``computed``: each scheduled
        request's computed tokens, as sent)."""
        follow_tables(self.tables, so, 0)
        for name, n in so.num_scheduled_tokens.items():
            need, held = min(computed[name] + n + self.slots, self.limit), len(self.tables[name])
            if held * self.block_size < need:
                raise AssertionError(
                    f"request {name}: {held} blocks for {need} positions "
                    f"({self.slots} lookahead slots past its work)"
                )


class RunnerEncoder:
    """The encoder outputs vLLM's runner holds (by item content hash): a step first drops
    the ones ``free_encoder_mm_hashes`` names, then computes its ``scheduled_encoder_inputs``;
    every item a scheduled request's work reaches must then be held (vLLM's GPU runner
    gathers each chunk's embeddings from that cache; a miss is an error there, here an
    ``AssertionError``)."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.items: dict[str, list[Any]] = {}  # each request's items (from its first step)
        self.computed = 0  # encoder inputs computed

    def step(self, so: Any, computed: dict[str, int]) -> None:
        for r in so.scheduled_new_reqs:
            self.items[r.req_id] = list(r.mm_features or ())
        self.held -= set(so.free_encoder_mm_hashes)
        for name, ids in so.scheduled_encoder_inputs.items():
            self.held |= {self.items[name][i].identifier for i in ids}
            self.computed += len(ids)
        for name, n in so.num_scheduled_tokens.items():
            start, end = computed[name], computed[name] + n
            for f in self.items.get(name, ()):
                p = f.mm_position
                if p.offset < end and start < p.offset + p.length and f.identifier not in self.held:
                    raise AssertionError(
                        f"request {name}: work [{start}, {end}) reaches item {f.identifier} "
                        "whose encoder output the runner does not hold"
                    )
