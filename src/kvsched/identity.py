"""Block identity: chained 128-bit digests over block tokens and extra keys.

``H(block i) = F(H(block i-1), tokens of block i as little-endian int32, extras)``, where the
chain starts from a root digest of the namespace (identity scheme, model, KV dtype and layout,
block size), the adapter and the cache salt, and ``extras`` are the content hashes of the
multimodal spans overlapping block i. Digests are stable across processes and machines (no
Python ``hash``, no process seed), so the external store and replays can use them as keys.

Two schemes (``SchedulerConfig.identity``; docs/identity.md has the security model):

- ``kvs128`` (the default): a keyed multiply-accumulate hash over 8 lanes (one
  32x32->64-bit product per 2 tokens, SSE2), then a short 128-bit finaliser that folds in the
  parent digest. Its keys are
  derived from the namespace root with blake2b, so a cache salt also changes every key. A
  whole prompt is one native call (``_kvs128.c``; ``_kvs128_py`` below is the same function in
  Python: the specification, the tests' reference, and the fallback where the extension is
  not built). Not collision resistant against someone who knows the keys.
- ``blake2b``: ``blake2b(H(block i-1) || tokens || extras, digest_size=16)``, one Python-level
  call per block (about 15 ns per token). Cryptographic; the scheme of every log before
  schema 4, which replay keeps using for them.

A sequence's digests live in a ``HashChain``: the packed digests of one kernel call plus those
appended one by one as decoding fills blocks.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Iterator, Sequence
from functools import lru_cache
from hashlib import blake2b

import msgspec
import numpy as np

from kvsched.config import IDENTITY_SCHEMES, ModelSpec
from kvsched.events.types import MultimodalSpan

try:
    from kvsched import _kvs128  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - only where the extension was not built
    _kvs128 = None

DIGEST_SIZE = 16  # bytes: 128 bits
_TOKEN_DTYPE = np.dtype("<i4")
_MASK = (1 << 64) - 1
_M32 = (1 << 32) - 1
_P1, _P3, _PM = 0x9E3779B97F4A7C15, 0x165667B19E3779F9, 0x165667919E3779F9
_EXTRA_WORD0 = 1 << 40
_STRIPE = 64
_NKEYS = 74
_ROOT_TAGS = {"blake2b": "kvsched-v1", "kvs128": "kvsched-kvs128-v1"}

Extras = dict[int, bytes]


def namespace_root(
    model: ModelSpec, block_size: int, adapter: str = "", salt: str = "", scheme: str = "kvs128"
) -> bytes:
    """The chain's root: everything that must match for two blocks to share KV."""
    if scheme not in IDENTITY_SCHEMES:
        raise ValueError(f"unknown identity scheme {scheme!r}; known: {IDENTITY_SCHEMES}")
    key = msgspec.msgpack.encode(
        [_ROOT_TAGS[scheme], model.name, model.kv_dtype, model.kv_layout, block_size, adapter, salt]
    )
    return blake2b(key, digest_size=DIGEST_SIZE).digest()


def span_extras(
    spans: Sequence[MultimodalSpan], block_size: int, first_block: int, last_block: int
) -> Extras:
    """Per block index in [first_block, last_block): hashes of the spans overlapping it."""
    extras: Extras = {}
    for span in spans:
        lo = max(first_block, span.start // block_size)
        hi = min(last_block, (span.end - 1) // block_size + 1)
        for b in range(lo, hi):
            extras[b] = extras.get(b, b"") + span.content_hash
    return extras


# ------------------------------------------------------------------------------ kvs128


@lru_cache(maxsize=1)
def kvs128_root() -> bytes:
    """A fixed root for kvs128 digests of data that is not a prompt (plan fields)."""
    return blake2b(b"kvsched-kvs128-data-v1", digest_size=DIGEST_SIZE).digest()


@lru_cache(maxsize=4096)
def kvs128_keys(root: bytes) -> bytes:
    """The 74 64-bit keys of a namespace (592 bytes): blake2b of the root, counter mode."""
    out = b"".join(
        blake2b(root + bytes([i]), digest_size=64, person=b"kvs128-keys").digest()
        for i in range(10)
    )
    return out[: 8 * _NKEYS]


def _mix(h: int) -> int:
    h = ((h ^ (h >> 37)) * _PM) & _MASK
    return h ^ (h >> 32)


def _fold(a: int, b: int) -> int:
    m = a * b
    return (m & _MASK) ^ (m >> 64)


def _absorb(acc: list[int], data: bytes, keys: Sequence[int], word: int) -> None:
    """Zero-padded 64-byte stripes of ``data`` into the 8 lanes, word indices from ``word``."""
    if len(data) % _STRIPE:
        data = data + bytes(_STRIPE - len(data) % _STRIPE)
    w = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    for i, x in enumerate(w):
        j = word + i
        d = x ^ ((keys[j & 63] + (j >> 6) * _P1) & _MASK)
        lane = i & 7
        acc[lane] = (acc[lane] + (d & _M32) * (d >> 32) + w[i ^ 1]) & _MASK


def _kvs128_py(
    parent: bytes, data: bytes, block_size: int, keys: bytes, extras: Sequence[tuple[int, bytes]]
) -> bytes:
    """The kvs128 chain in Python: what ``_kvs128.chain`` computes (its specification)."""
    k = _key_words(keys)
    extra_of = dict(extras)
    h = (int.from_bytes(parent[:8], "little"), int.from_bytes(parent[8:], "little"))
    step = 4 * block_size
    out = []
    for b in range(len(data) // step):
        acc = [0] * 8
        _absorb(acc, data[b * step : (b + 1) * step], k, 0)
        extra = extra_of.get(b, b"")
        if extra:
            _absorb(acc, extra, k, _EXTRA_WORD0)
        h = _finish(h, acc, len(extra), k)
        out.append(h[0].to_bytes(8, "little") + h[1].to_bytes(8, "little"))
    return b"".join(out)


def _key_words(keys: bytes) -> list[int]:
    return [int.from_bytes(keys[8 * i : 8 * i + 8], "little") for i in range(_NKEYS)]


def _finish(h: tuple[int, int], acc: list[int], extra_len: int, k: list[int]) -> tuple[int, int]:
    """The finaliser: the 8 lanes folded into 128 bits, mixed with the parent ``h``."""
    u = (_fold(acc[0] ^ k[64], acc[1] ^ k[65]) + _fold(acc[2] ^ k[66], acc[3] ^ k[67])) & _MASK
    v = (_fold(acc[4] ^ k[68], acc[5] ^ k[69]) + _fold(acc[6] ^ k[70], acc[7] ^ k[71])) & _MASK
    x0 = h[0] ^ u ^ ((extra_len * _P3) & _MASK)
    x1 = h[1] ^ v
    m = (x0 ^ k[72]) * (x1 ^ k[73])
    return _mix(((m & _MASK) + x1) & _MASK), _mix(((m >> 64) + x0) & _MASK)


_FIELD_BLOCK = 1024  # bytes per block of kvs128_digest


def _kvs128_digest_py(parent: bytes, data: bytes, keys: bytes) -> bytes:
    """What ``_kvs128.digest`` computes: any bytes as a chain of 1 KiB blocks from ``parent``,
    the last one zero-padded and the length (plus one) folded in as its extra length."""
    k = _key_words(keys)
    h = (int.from_bytes(parent[:8], "little"), int.from_bytes(parent[8:], "little"))
    whole = len(data) // _FIELD_BLOCK * _FIELD_BLOCK
    for off in range(0, whole, _FIELD_BLOCK):
        acc = [0] * 8
        _absorb(acc, data[off : off + _FIELD_BLOCK], k, 0)
        h = _finish(h, acc, 0, k)
    acc = [0] * 8
    if len(data) > whole:
        _absorb(acc, data[whole:], k, 0)
    h = _finish(h, acc, len(data) + 1, k)
    return h[0].to_bytes(8, "little") + h[1].to_bytes(8, "little")


def kvs128_digest(parent: bytes, data: np.ndarray | bytes) -> bytes:
    """A 16-byte kvs128 digest of any contiguous bytes (plan fields), keyed by the fixed
    data root (``kvs128_root``), continuing ``parent`` (e.g. a digest of what the bytes are)."""
    keys = kvs128_keys(kvs128_root())
    if _kvs128 is not None:
        out: bytes = _kvs128.digest(parent, data, keys)
        return out
    raw = data.tobytes() if isinstance(data, np.ndarray) else data
    return _kvs128_digest_py(parent, raw, keys)


_NATIVE_WARNED = False


def _kvs128_chain(
    parent: bytes, data: np.ndarray, block_size: int, keys: bytes, extras: list[tuple[int, bytes]]
) -> tuple[bytes, int | None]:
    if _kvs128 is not None:
        packed, top = _kvs128.chain(parent, data, block_size, keys, extras or None, True)
        return packed, top
    global _NATIVE_WARNED
    if not _NATIVE_WARNED:
        _NATIVE_WARNED = True
        warnings.warn(
            "kvsched._kvs128 is not built: block identity runs in pure Python (slow); "
            "reinstall kvsched with a C compiler available",
            RuntimeWarning,
            stacklevel=3,
        )
    return _kvs128_py(parent, data.tobytes(), block_size, keys, extras), None


# ---------------------------------------------------------------------- both schemes


def chain_packed(
    scheme: str,
    root: bytes,
    parent: bytes,
    tokens: np.ndarray,
    block_size: int,
    first_block: int = 0,
    extras: Extras | None = None,
) -> bytes:
    """Packed digests (16 bytes each) of the full blocks of ``tokens``, which start at block
    index ``first_block`` of a chain rooted at ``root`` and continue ``parent``."""
    return chain_and_max(scheme, root, parent, tokens, block_size, first_block, extras)[0]


def chain_and_max(
    scheme: str,
    root: bytes,
    parent: bytes,
    tokens: np.ndarray,
    block_size: int,
    first_block: int = 0,
    extras: Extras | None = None,
) -> tuple[bytes, int | None]:
    """``chain_packed``, and the largest token id of all of ``tokens`` read as unsigned
    32-bit (a negative id is larger than any vocabulary) where the same pass computed it
    (the native kvs128 kernel), else None."""
    data = np.ascontiguousarray(tokens, dtype=_TOKEN_DTYPE)
    if scheme == "kvs128":
        rel = sorted((b - first_block, x) for b, x in extras.items() if x) if extras else []
        return _kvs128_chain(parent, data, block_size, kvs128_keys(root), rel)
    if scheme != "blake2b":
        raise ValueError(f"unknown identity scheme {scheme!r}; known: {IDENTITY_SCHEMES}")
    raw = data.tobytes()
    step = block_size * _TOKEN_DTYPE.itemsize
    out: list[bytes] = []
    for i in range(len(raw) // step):
        h = blake2b(parent, digest_size=DIGEST_SIZE)
        h.update(raw[i * step : (i + 1) * step])
        if extras:
            extra = extras.get(first_block + i)
            if extra:
                h.update(extra)
        parent = h.digest()
        out.append(parent)
    return b"".join(out), None


def chain_hashes(
    root: bytes,
    tokens: np.ndarray,
    block_size: int,
    first_block: int = 0,
    extras: Extras | None = None,
    *,
    parent: bytes | None = None,
    scheme: str = "kvs128",
) -> list[bytes]:
    """The digests of the full blocks of ``tokens`` as a list (``chain_packed`` unpacked);
    the chain continues ``parent`` (default: the root itself)."""
    packed = chain_packed(
        scheme, root, root if parent is None else parent, tokens, block_size, first_block, extras
    )
    return split_digests(packed)


def block_hash(
    scheme: str, root: bytes, parent: bytes, tokens: np.ndarray, extra: bytes = b""
) -> bytes:
    """The digest of one full block (``chain_packed`` of one block)."""
    return chain_packed(scheme, root, parent, tokens, len(tokens), 0, {0: extra} if extra else None)


def split_digests(packed: bytes) -> list[bytes]:
    return [packed[i : i + DIGEST_SIZE] for i in range(0, len(packed), DIGEST_SIZE)]


class HashChain:
    """A sequence's block digests: digest ``i`` names block ``i``. Packed digests from one
    kernel call (``chain_packed``), then digests appended one at a time; reading one slices
    it out (no per-block object exists until it is read)."""

    __slots__ = ("_more", "_n", "_packed")

    def __init__(self, packed: bytes = b"", more: list[bytes] | None = None) -> None:
        if len(packed) % DIGEST_SIZE:
            raise ValueError(f"packed digests must be whole {DIGEST_SIZE}-byte digests")
        self._packed = packed
        self._n = len(packed) // DIGEST_SIZE
        self._more: list[bytes] = more if more is not None else []

    def __len__(self) -> int:
        return self._n + len(self._more)

    def __getitem__(self, i: int) -> bytes:
        n = self._n
        if i < 0:
            i += n + len(self._more)
        if 0 <= i < n:
            return self._packed[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE]
        if i < 0:
            raise IndexError("hash chain index out of range")
        return self._more[i - n]

    def __iter__(self) -> Iterator[bytes]:
        yield from split_digests(self._packed)
        yield from self._more

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HashChain):
            return self.packed() == other.packed()
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"HashChain({len(self)} digests)"

    def longest_prefix_in(self, index: Container[bytes], limit: int) -> int:
        """How many leading digests of the first ``limit`` are in ``index``, for an index
        that is prefix-closed (a digest is in it only if its parent is): binary search."""
        hi = min(limit, len(self))
        if hi <= 0 or self[0] not in index:
            return 0
        lo = 1  # digests [0, lo) are in the index; the answer is in [lo, hi]
        packed, n = self._packed, self._n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            i = mid - 1
            digest = packed[i * DIGEST_SIZE : mid * DIGEST_SIZE] if i < n else self._more[i - n]
            if digest in index:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def last(self, default: bytes) -> bytes:
        """The deepest digest, or ``default`` (the root) for an empty chain."""
        if self._more:
            return self._more[-1]
        return self._packed[-DIGEST_SIZE:] if self._n else default

    def append(self, digest: bytes) -> None:
        self._more.append(digest)

    def packed(self, lo: int = 0, hi: int | None = None) -> bytes:
        """Digests ``lo..hi`` concatenated (the form events carry)."""
        n = len(self)
        hi = n if hi is None else min(hi, n)
        if hi <= self._n:
            return self._packed[lo * DIGEST_SIZE : hi * DIGEST_SIZE]
        head = self._packed[lo * DIGEST_SIZE :] if lo < self._n else b""
        return head + b"".join(self._more[max(0, lo - self._n) : hi - self._n])

    def digests(self, lo: int, hi: int) -> list[bytes]:
        return split_digests(self.packed(lo, hi))

    def prefix(self, k: int) -> HashChain:
        """The first ``k`` digests as a new chain."""
        if k <= self._n:
            return HashChain(self._packed[: k * DIGEST_SIZE])
        return HashChain(self._packed, self._more[: k - self._n])

    def extended(self, packed: bytes) -> HashChain:
        """A new chain: these digests, then ``packed``."""
        if not self._more:
            return HashChain(self._packed + packed if self._packed else packed)
        return HashChain(self.packed() + packed)


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
    hashes: HashChain,
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
