"""kvsched's cache events as vLLM KV events (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``), so a KV-cache-aware router built for vLLM can follow kvsched's cache.

Blocks are named by the hashes vLLM's own block hasher put on each request
(``Request.block_hashes``, converted as vLLM converts them for events), so the stream is what
vLLM's own scheduler would publish for the same cache. Only index changes are published: a
private copy (``PRIVATE_COPY``) is not cached and is never announced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvsched.events import types as ev

Convert = Callable[[bytes], Any]  # vLLM's maybe_convert_block_hash


class KVEventTranslator:
    """Folds kvsched's cache decisions into vLLM event objects; keeps the kvsched-hash ->
    vLLM-hash name of every cached block (to name evictions)."""

    def __init__(self, block_size: int, convert: Convert, factories: dict[str, type]) -> None:
        self.block_size = block_size
        self.convert = convert
        self.stored, self.removed, self.cleared = (
            factories["BlockStored"],
            factories["BlockRemoved"],
            factories["AllBlocksCleared"],
        )
        self.names: dict[bytes, Any] = {}  # kvsched block hash -> vLLM event hash

    def translate(
        self, decisions: Sequence[ev.Event], request_of: Callable[[int], Any]
    ) -> list[Any]:
        out: list[Any] = []
        for d in decisions:
            if isinstance(d, ev.BlocksCached):
                out += self._stored(d, request_of)
            elif isinstance(d, ev.BlocksEvicted):
                names = [self.names.pop(h) for h in ev.split_hashes(d.hashes)]
                out.append(self.removed(block_hashes=names, medium="GPU"))
            elif isinstance(d, ev.CacheCleared):
                self.names.clear()
                out.append(self.cleared())
        return out

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
            medium="GPU",
            lora_name=None,
        )
