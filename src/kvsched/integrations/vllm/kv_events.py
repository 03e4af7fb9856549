"""kvsched's cache events as vLLM KV events (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``), so a KV-cache-aware router built for vLLM can follow kvsched's cache.

Blocks are named by the hashes vLLM's own block hasher put on each request
(``Request.block_hashes``, converted as vLLM converts them for events), so the stream is what
vLLM's own scheduler would publish for the same cache. Only index changes are published: a
private copy (``PRIVATE_COPY``) is not cached and is never announced.

Hybrid models: vLLM 0.32 tags every event with the KV cache group it is about (``group_idx``)
and a store with the group's kind (``kv_cache_spec_kind``: "full_attention", "mamba"). The
attention blocks go out under the full-attention group. A kvsched checkpoint (the recurrent
state after ``n`` tokens, block-aligned under vLLM's align mode) is what vLLM keeps as a
mamba block: it is published when kvsched publishes it, once per mamba group, and withdrawn
when it is evicted or released, in one of two forms:

* **one block** (every mamba group but the routed one): a one-block ``BlockStored`` named by
  the request's block hash at the checkpoint's depth (``block_hashes[n // block_size - 1]``,
  the same name as the attention block ending there; ``token_ids`` that block's,
  ``parent_block_hash`` the block before it), and ``BlockRemoved([name])`` when it goes. A
  subscriber reading one such group has kvsched's checkpoint set exactly.
* **the chain** (the routed group, ``ROUTED_GROUP``, when it is a mamba group: group 0, the
  one vllm-router's kv_aware scores, and a mamba group in vLLM 0.32's hybrid layout): one
  ``BlockStored`` carrying every block from the first to the checkpoint's (their names,
  their ``token_ids``, ``parent_block_hash`` None), so a router that walks a prompt's blocks
  from the first one credits exactly the prefixes a state lies at the end of, on the server
  holding it. Blocks are counted per live checkpoint covering them; a ``BlockRemoved``
  names the blocks (deepest first) that no live checkpoint covers any more. For a model
  with a single mamba group (group 0) the chain form is the only one: the stream then says
  which prefixes end in a state, or precede one, not exactly which checkpoints live.

vLLM's own mamba stores carry the tokens since the request's previous chunk end; a router
keys on the group and the tokens (vllm-router) or the hash (docs/several-engines.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsched.events import types as ev

Convert = Callable[[bytes], Any]  # vLLM's maybe_convert_block_hash
# (request, first block, number of blocks, block size) -> the stores' ``extra_keys`` (vLLM's
# per-block extra keys of the hash, e.g. the cache salt of block 0; outputs.extra_keys)
ExtraKeys = Callable[[Any, int, int, int], Any]


def no_extra_keys(request: Any, first: int, count: int, block_size: int) -> None:
    """No extra keys (requests without a cache salt, LoRA or multimodal inputs)."""
    return None


MEDIUM = "GPU"  # vLLM's BlockPool default (MEDIUM_GPU), which its KVCacheManager keeps
FULL_ATTENTION, MAMBA = "full_attention", "mamba"  # vLLM's KVCacheSpecKind values
# The KV cache group a KV-aware router scores: vllm-router 0.1.17's kv_aware indexes group 0
# only (docs/several-engines.md, measured); checkpoints go there as chains when it is a
# mamba group.
ROUTED_GROUP = 0


@dataclass(frozen=True)
class EventGroups:
    """vLLM's KV cache groups as events name them: the full-attention group's index and the
    mamba groups' (none for an attention-only model)."""

    attention: int = 0
    mamba: tuple[int, ...] = ()

    @property
    def chain(self) -> int | None:
        """The mamba group checkpoints are published to as chains (``ROUTED_GROUP`` when it
        is a mamba group), None if none is."""
        return ROUTED_GROUP if ROUTED_GROUP in self.mamba else None


@dataclass(frozen=True)
class _State:
    """A reserved checkpoint's vLLM blocks: the names of the blocks from the first to its
    own (``names[-1]``, its name; without a chain group only its parent's and its own), their
    tokens (without a chain group its own block's), the extra keys of its own block and of the
    chain (None unless a chain group is published), its session."""

    names: list[Any]
    token_ids: list[int]
    extra_keys: Any
    chain_extra_keys: Any
    session_id: str | None


class KVEventTranslator:
    """Folds kvsched's cache decisions into vLLM event objects; keeps the kvsched-hash ->
    vLLM-hash name of every cached block (to name evictions) and the vLLM name of every
    published checkpoint."""

    def __init__(
        self,
        block_size: int,
        convert: Convert,
        factories: dict[str, type],
        groups: EventGroups = EventGroups(),
        extra_keys: ExtraKeys = no_extra_keys,
    ) -> None:
        self.block_size = block_size
        self.convert = convert
        self.groups = groups
        self.extra_keys = extra_keys
        self.stored, self.removed, self.cleared = (
            factories["BlockStored"],
            factories["BlockRemoved"],
            factories["AllBlocksCleared"],
        )
        self.names: dict[bytes, Any] = {}  # kvsched block hash -> vLLM event hash
        self.states: dict[int, Any] = {}  # published checkpoint id -> vLLM event hash
        self.chains: dict[int, list[Any]] = {}  # published checkpoint id -> its chain's names
        self.covered: dict[Any, int] = {}  # chain-group name -> live checkpoints covering it
        self._reserved: dict[int, _State] = {}  # reserved, not yet published

    def translate(
        self, decisions: Sequence[ev.Event], request_of: Callable[[int], Any]
    ) -> list[Any]:
        out: list[Any] = []
        for d in decisions:
            if isinstance(d, ev.BlocksCached):
                out += self._stored(d, request_of)
            elif isinstance(d, ev.BlocksEvicted):
                names = [self.names.pop(h) for h in ev.split_hashes(d.hashes)]
                out.append(
                    self.removed(block_hashes=names, medium=MEDIUM, group_idx=self.groups.attention)
                )
            elif isinstance(d, ev.CacheCleared):
                self.names.clear()
                self.states.clear()  # (vLLM's AllBlocksCleared clears every group)
                self.chains.clear()
                self.covered.clear()
                out.append(self.cleared())
            elif self.groups.mamba:
                out += self._checkpoint(d, request_of)
        return out

    def cache_names(self, state: Any) -> dict[str, list[str]]:
        """The vLLM event names (as strings) of an ``EngineState``'s cache: "blocks", every
        block of the prefix index; "checkpoints", every published checkpoint, named here
        independently of how it was announced: an aligned checkpoint's identity is the
        kvsched hash of the block ending at its depth, which is cached while the checkpoint
        lives, so its name is that block's. KeyError if a block was never announced."""
        names = self.names
        return {
            "blocks": sorted(str(names[h]) for h in state.pool.index),
            "checkpoints": sorted(str(names[key]) for key in state.ckpts.index),
        }

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self, d: ev.Event, request_of: Callable[[int], Any]) -> list[Any]:
        """A checkpoint decision: reserved (named now, while its request is at hand),
        published (stored per mamba group), evicted or released (removed per group)."""
        if isinstance(d, ev.CheckpointReserved):
            self._reserved[d.ckpt_id] = self._state(d, request_of(d.seq_id))
        elif isinstance(d, ev.CheckpointAbandoned):
            self._reserved.pop(d.ckpt_id, None)
        elif isinstance(d, ev.CheckpointPublished):
            return self._published(d.ckpt_id, self._reserved.pop(d.ckpt_id))
        elif (
            isinstance(d, (ev.CheckpointEvicted, ev.CheckpointReleased))
            and d.ckpt_id in self.states  # (else withdrawn already by an AllBlocksCleared)
        ):
            return self._withdrawn(d.ckpt_id)
        return []

    def _published(self, ckpt_id: int, s: _State) -> list[Any]:
        self.states[ckpt_id] = s.names[-1]
        chain = self.groups.chain
        if chain is not None:
            self.chains[ckpt_id] = s.names
            for name in s.names:
                self.covered[name] = self.covered.get(name, 0) + 1
        return [
            self._chain_stored(s, g) if g == chain else self._state_stored(s, g)
            for g in self.groups.mamba
        ]

    def _withdrawn(self, ckpt_id: int) -> list[Any]:
        """The removals of a published checkpoint: its block in each one-block group; in the
        chain group, the blocks of its chain no other live checkpoint covers (none: nothing)."""
        name, chain = self.states.pop(ckpt_id), self.groups.chain
        out = [
            self.removed(block_hashes=[name], medium=MEDIUM, group_idx=g)
            for g in self.groups.mamba
            if g != chain
        ]
        if chain is not None:
            uncovered = self._uncover(self.chains.pop(ckpt_id))
            if uncovered:
                out.insert(
                    self.groups.mamba.index(chain),
                    self.removed(block_hashes=uncovered, medium=MEDIUM, group_idx=chain),
                )
        return out

    def _uncover(self, names: list[Any]) -> list[Any]:
        """Drop one live checkpoint's cover of ``names``; the names left uncovered, deepest
        first."""
        gone = []
        for name in reversed(names):
            left = self.covered[name] - 1
            if left:
                self.covered[name] = left
            else:
                del self.covered[name]
                gone.append(name)
        return gone

    def _state(self, d: ev.CheckpointReserved, request: Any) -> _State:
        """The vLLM blocks up to the state after ``d.num_tokens`` tokens of ``request``."""
        bs = self.block_size
        if d.num_tokens % bs or d.num_tokens <= 0:
            raise ValueError(
                f"checkpoint {d.ckpt_id} after {d.num_tokens} tokens is not block-aligned "
                f"(block {bs}): vLLM names a state by its whole block (align mode)"
            )
        blocks = d.num_tokens // bs
        chained = self.groups.chain is not None
        # (without a chain group only the state's block and its parent are published)
        first, tokens_from = (0, 0) if chained else (max(0, blocks - 2), d.num_tokens - bs)
        return _State(
            names=[self.convert(h) for h in request.block_hashes[first:blocks]],
            token_ids=list(request.all_token_ids[tokens_from : d.num_tokens]),
            extra_keys=self.extra_keys(request, blocks - 1, 1, bs),
            chain_extra_keys=self.extra_keys(request, 0, blocks, bs) if chained else None,
            session_id=getattr(request, "session_id", None),
        )

    def _state_stored(self, s: _State, group: int) -> Any:
        """The checkpoint's own block (the one-block form)."""
        return self._mamba_stored(
            s.names[-1:],
            s.names[-2] if len(s.names) > 1 else None,
            s.token_ids[-self.block_size :],
            s.extra_keys,
            s.session_id,
            group,
        )

    def _chain_stored(self, s: _State, group: int) -> Any:
        """Every block from the first to the checkpoint's (the chain form)."""
        return self._mamba_stored(
            s.names, None, s.token_ids, s.chain_extra_keys, s.session_id, group
        )

    def _mamba_stored(
        self,
        names: list[Any],
        parent: Any,
        token_ids: list[int],
        extra_keys: Any,
        session_id: str | None,
        group: int,
    ) -> Any:
        return self.stored(
            block_hashes=list(names),
            parent_block_hash=parent,
            token_ids=list(token_ids),
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
            extra_keys=extra_keys,
            group_idx=group,
            kv_cache_spec_kind=MAMBA,
            session_id=session_id,
        )

    # ------------------------------------------------------------------ attention blocks

    def _stored(self, e: ev.BlocksCached, request_of: Callable[[int], Any]) -> list[Any]:
        out: list[Any] = []
        hashes = ev.split_hashes(e.hashes)
        replaced = e.replaced.tolist()
        j = 0
        for seq_id, count, start in zip(
            e.seq_ids.tolist(), e.counts.tolist(), e.starts.tolist(), strict=True
        ):
            request = request_of(seq_id)
            tokens = request.all_token_ids
            names: list[Any] = []
            first = -1
            for depth in range(start, start + count):
                if replaced[j] == 0:
                    name = self.convert(request.block_hashes[depth])
                    self.names[hashes[j]] = name
                    names.append(name)
                    first = depth if first < 0 else first
                elif names:  # a private copy breaks the run: publish what came before it
                    out.append(self._event(names, first, request, tokens))
                    names, first = [], -1
                j += 1
            if names:
                out.append(self._event(names, first, request, tokens))
        return out

    def _event(self, names: list[Any], first: int, request: Any, tokens: Sequence[int]) -> Any:
        bs = self.block_size
        parent = self.convert(request.block_hashes[first - 1]) if first else None
        return self.stored(
            block_hashes=names,
            parent_block_hash=parent,
            token_ids=list(tokens[first * bs : (first + len(names)) * bs]),
            block_size=bs,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
            extra_keys=self.extra_keys(request, first, len(names), bs),
            group_idx=self.groups.attention,
            kv_cache_spec_kind=FULL_ATTENTION,
            session_id=getattr(request, "session_id", None),
        )
