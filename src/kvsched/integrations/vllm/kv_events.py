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
mamba block: it is published when kvsched publishes it, once per mamba group, as a
one-block ``BlockStored`` named by the request's block hash at the checkpoint's depth
(``block_hashes[n // block_size - 1]``, the same name as the attention block ending there),
and withdrawn (``BlockRemoved`` per mamba group) when it is evicted or released. vLLM's own
mamba stores carry the tokens since the request's previous chunk end; kvsched's carry the
checkpoint's own block (``token_ids`` = that block's tokens, ``parent_block_hash`` the block
before it): a router keys on the hash and the group.
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


@dataclass(frozen=True)
class EventGroups:
    """vLLM's KV cache groups as events name them: the full-attention group's index and the
    mamba groups' (none for an attention-only model)."""

    attention: int = 0
    mamba: tuple[int, ...] = ()


@dataclass(frozen=True)
class _State:
    """A reserved checkpoint's vLLM block: its name, its parent's, its tokens, its extra
    keys, its session."""

    name: Any
    parent: Any
    token_ids: list[int]
    extra_keys: Any
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
            s = self._reserved.pop(d.ckpt_id)
            self.states[d.ckpt_id] = s.name
            return [self._state_stored(s, g) for g in self.groups.mamba]
        elif isinstance(d, (ev.CheckpointEvicted, ev.CheckpointReleased)):
            name = self.states.pop(d.ckpt_id, None)
            if name is not None:  # (None: withdrawn already by an AllBlocksCleared)
                return [
                    self.removed(block_hashes=[name], medium=MEDIUM, group_idx=g)
                    for g in self.groups.mamba
                ]
        return []

    def _state(self, d: ev.CheckpointReserved, request: Any) -> _State:
        """The vLLM block holding the state after ``d.num_tokens`` tokens of ``request``."""
        bs = self.block_size
        if d.num_tokens % bs or d.num_tokens <= 0:
            raise ValueError(
                f"checkpoint {d.ckpt_id} after {d.num_tokens} tokens is not block-aligned "
                f"(block {bs}): vLLM names a state by its whole block (align mode)"
            )
        depth = d.num_tokens // bs - 1
        hashes = request.block_hashes
        return _State(
            name=self.convert(hashes[depth]),
            parent=self.convert(hashes[depth - 1]) if depth else None,
            token_ids=list(request.all_token_ids[depth * bs : d.num_tokens]),
            extra_keys=self.extra_keys(request, depth, 1, bs),
            session_id=getattr(request, "session_id", None),
        )

    def _state_stored(self, s: _State, group: int) -> Any:
        return self.stored(
            block_hashes=[s.name],
            parent_block_hash=s.parent,
            token_ids=s.token_ids,
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
            extra_keys=s.extra_keys,
            group_idx=group,
            kv_cache_spec_kind=MAMBA,
            session_id=s.session_id,
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
