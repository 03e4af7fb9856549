"""What every event shares: the ``Event`` base, block-hash blobs, multimodal spans."""

from __future__ import annotations

import msgspec
import numpy as np

I32 = np.int32
I64 = np.int64


HASH_SIZE = 16  # bytes per block hash in ``hashes`` / ``parents`` fields


class Event(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """Base of every event."""


def split_hashes(blob: bytes) -> list[bytes]:
    """The 16-byte digests of a ``hashes`` field, in order."""
    n = HASH_SIZE
    return [blob[i : i + n] for i in range(0, len(blob), n)]


class MultimodalSpan(msgspec.Struct, frozen=True):
    """Prompt positions [start, end) filled by one image/video, with its content hash."""

    start: int
    end: int
    content_hash: bytes
