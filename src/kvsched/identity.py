"""Block identity: chained 128-bit blake2b hashes over block tokens and extra keys.

``H(block i) = blake2b(H(block i-1) || tokens of block i as little-endian int32 || extras)``,
where the chain starts from a root digest of the namespace (model, KV dtype and layout, block
size), the adapter and the cache salt, and ``extras`` are the content hashes of the multimodal
spans overlapping block i. Digests are stable across processes and machines (no Python
``hash``), so the external store and replays can use them as keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import msgspec
import numpy as np

from kvsched.config import ModelSpec
from kvsched.events.types import MultimodalSpan

DIGEST_SIZE = 16  # bytes: 128 bits
_TOKEN_DTYPE = np.dtype("<i4")


def namespace_root(model: ModelSpec, block_size: int, adapter: str = "", salt: str = "") -> bytes:
    """The chain's root: everything that must match for two blocks to share KV."""
    key = msgspec.msgpack.encode(
        ["kvsched-v1", model.name, model.kv_dtype, model.kv_layout, block_size, adapter, salt]
    )
    return blake2b(key, digest_size=DIGEST_SIZE).digest()


def span_extras(
    spans: Sequence[MultimodalSpan], block_size: int, first_block: int, last_block: int
) -> dict[int, bytes]:
    """Per block index in [first_block, last_block): hashes of the spans overlapping it."""
    extras: dict[int, bytes] = {}
    for span in spans:
        lo = max(first_block, span.start // block_size)
        hi = min(last_block, (span.end - 1) // block_size + 1)
        for b in range(lo, hi):
            extras[b] = extras.get(b, b"") + span.content_hash
    return extras


def block_hash(parent: bytes, tokens: np.ndarray, extra: bytes = b"") -> bytes:
    """The hash of one full block (``chain_hashes`` of one block, without its loop)."""
    h = blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(np.ascontiguousarray(tokens, dtype=_TOKEN_DTYPE).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def chain_hashes(
    parent: bytes,
    tokens: np.ndarray,
    block_size: int,
    first_block: int = 0,
    extras: dict[int, bytes] | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``tokens``, which start at block index ``first_block``."""
    data = np.ascontiguousarray(tokens, dtype=_TOKEN_DTYPE).tobytes()
    step = block_size * _TOKEN_DTYPE.itemsize
    out: list[bytes] = []
    for i in range(len(data) // step):
        h = blake2b(parent, digest_size=DIGEST_SIZE)
        h.update(data[i * step : (i + 1) * step])
        if extras:
            extra = extras.get(first_block + i)
            if extra:
                h.update(extra)
        parent = h.digest()
        out.append(parent)
    return out


def partial_key(anchor: bytes, tail: np.ndarray, extra: bytes = b"") -> bytes:
    """Identity of a non-aligned checkpoint: the anchor block's hash, the tail tokens and the
    content hashes of the multimodal spans overlapping the tail (``tail_extra``)."""
    h = blake2b(anchor, digest_size=DIGEST_SIZE, person=b"kvs-partial")
    h.update(np.ascontiguousarray(tail, dtype=_TOKEN_DTYPE).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def tail_extra(spans: Sequence[MultimodalSpan], start: int, end: int) -> bytes:
    """Content hashes of the spans overlapping tokens [start, end), as full blocks hash them."""
    return b"".join(s.content_hash for s in spans if s.start < end and start < s.end)


def checkpoint_identity(
    root: bytes,
    hashes: Sequence[bytes],
    tokens: np.ndarray,
    spans: Sequence[MultimodalSpan],
    step: int,
    block_size: int,
) -> tuple[bytes, bytes]:
    """(identity, anchor) of the recurrent state after ``step`` tokens of a chain: for an
    aligned step the hash of its last full block (the root below one block), else a digest of
    that anchor, the tail tokens and the spans overlapping them."""
    depth = step // block_size
    anchor = hashes[depth - 1] if depth else root
    if step % block_size == 0:
        return anchor, anchor
    extra = tail_extra(spans, depth * block_size, step)
    return partial_key(anchor, tokens[depth * block_size : step], extra), anchor
