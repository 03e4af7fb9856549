"""Multimodal spans: where a computation may start or stop (pure functions of a request).

An image or video fills a span of prompt positions ``[start, end)`` and is consumed whole (its
encoder embeds the whole span; lmdeploy never splits one). So no chunk boundary, prefix hit,
load end or saved state falls strictly inside a span: a position ``p`` is a safe boundary when
no span has ``start < p < end`` (a span's own ends are safe).

Chunks stay canonical (a function of the request and the config only, never of a hit):
the canonical boundaries are the multiples of the chunk length and the prompt end; one inside
a span is replaced by that span's two ends, so a span is a chunk of its own however long
(lmdeploy's chunk limit is at least the largest span) and every other chunk stays within the
length. Overlapping spans count as one (their union).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsched.events.types import MultimodalSpan


def boundary_safe(spans: Sequence[MultimodalSpan], step: int) -> bool:
    """Whether a computation may stop (or start) after ``step`` tokens: no span is split."""
    return all(not span.start < step < span.end for span in spans)


def safe_depth(spans: Sequence[MultimodalSpan], depth: int, block_size: int) -> int:
    """The deepest block boundary at or below block ``depth`` that is safe (lmdeploy's clamp:
    rewind to the start of the span it is in, round down to a block, repeat)."""
    step = depth * block_size
    while step > 0:
        starts = [span.start for span in spans if span.start < step < span.end]
        if not starts:
            break
        step = min(starts) // block_size * block_size
    return step // block_size


def embedded(spans: Sequence[MultimodalSpan], start: int, end: int) -> int:
    """The span positions a chunk ``[start, end)`` embeds: those of the spans starting in it
    (a chunk never splits a span, so it embeds each of them whole)."""
    return sum(span.end - span.start for span in spans if start <= span.start < end)


def merged(spans: Sequence[MultimodalSpan]) -> list[tuple[int, int]]:
    """The spans as disjoint sorted intervals (overlapping ones joined)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((s.start, s.end) for s in spans):
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def chunk_end(spans: Sequence[MultimodalSpan], start: int, end: int) -> int:
    """The canonical end of a chunk from a safe ``start`` whose grid end is ``end`` (the next
    multiple of the chunk length, or the prompt end): ``end`` if safe, else the start of the
    span it is in when that span starts after ``start``, else that span's end (the span is a
    chunk of its own)."""
    for lo, hi in merged(spans):
        if lo < end < hi:
            return lo if lo > start else hi
    return end
