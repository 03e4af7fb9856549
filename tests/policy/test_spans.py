"""Multimodal spans' boundary rules (``policy/spans.py``), as pure functions."""

from __future__ import annotations

from kvsched.events.types import MultimodalSpan
from kvsched.policy import spans


def span(start: int, end: int) -> MultimodalSpan:
    return MultimodalSpan(start, end, bytes([start]) * 16)


def test_a_spans_own_start_and_end_are_safe_boundaries_and_only_its_inside_is_not() -> None:
    image = [span(4, 8)]
    safe = [p for p in range(11) if spans.boundary_safe(image, p)]
    assert safe == [0, 1, 2, 3, 4, 8, 9, 10], "a span's start (or end) was treated as unsafe"


def test_rewinding_out_of_a_span_rounds_down_to_a_block_and_checks_that_boundary_again() -> None:
    """Depth 4 (16 tokens, block 4) is inside [7, 20): its start rounds down to 4, which is
    inside [3, 6): its start rounds down to 0."""
    images = [span(3, 6), span(7, 20)]
    assert spans.safe_depth(images, 4, 4) == 0
    assert spans.safe_depth([span(7, 20)], 4, 4) == 1  # (one rewind is enough alone)
