"""Multimodal spans: where a computation may start or stop (pure functions of a request).

An image or video fills a span of prompt positions ``[start, end)`` and is consumed whole (its
encoder embeds the whole span; lmdeploy never splits one). So no chunk boundary, prefix hit,
load end or saved state falls strictly inside a span: a position ``p`` is a safe boundary when
no span has ``start < p < end`` (a span's own ends are safe).

An executor that keeps a span's encoder output across a request's chunks (vLLM's runner:
``model.span_slices``) lifts the rule: hits, chunks and states may end inside a span
(``kept_whole``), and the block identity still names every span a block overlaps.

Chunks stay canonical (a function of the request and the config only, never of a hit):
the canonical boundaries are the multiples of the chunk length and the prompt end; one inside
a span is replaced by that span's two ends, so a span is a chunk of its own however long
(lmdeploy's chunk limit is at least the largest span) and every other chunk stays within the
length. Overlapping spans count as one (their union).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsched.config import SchedulerConfig
from kvsched.events.types import MultimodalSpan


def kept_whole(config: SchedulerConfig) -> bool:
    """Whether no computation may start or stop inside a span: the executor embeds a span
    whole (lmdeploy's), unless it keeps a span's encoder output across the request's chunks
    (``model.span_slices``: vLLM's runner, which slices it; a hit, chunk or state may then
    end anywhere) or the log is older than schema 4 (``legacy.multimodal_safe``)."""
    return config.legacy.multimodal_safe and not config.model.span_slices


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


def embedded(
    spans: Sequence[MultimodalSpan], start: int, end: int, whole: bool = True, held: bool = False
) -> int:
    """The span positions a chunk ``[start, end)`` embeds, each span counted whole: those
    starting in it when spans are kept whole; else every span it reaches, but for one that
    a running sequence's earlier chunk stopped inside (``held``: its encoder output is held
    since then, ``held_positions``)."""
    if whole:
        return sum(span.end - span.start for span in spans if start <= span.start < end)
    return sum(
        span.end - span.start
        for span in spans
        if span.start < end and start < span.end and not (held and span.start < start)
    )


def held_positions(spans: Sequence[MultimodalSpan], computed: int, since: int) -> int:
    """The span positions whose encoder output a running sequence holds at a step's start:
    a span its computed work stopped strictly inside (``computed``), and, with steps still
    in flight, every span their work (from ``since``) reached, until their outcome lands."""
    return sum(
        span.end - span.start
        for span in spans
        if span.start < computed and (since < span.end if since < computed else computed < span.end)
    )


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
