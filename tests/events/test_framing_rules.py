"""Frame parsing (``events/framing.py``): how much a torn frame is missing."""

from __future__ import annotations

import io

from kvsched.events.framing import PREFIX_SIZE, TornTail, encode_frame, read_frame


def _read(data: bytes) -> object:
    return read_frame(io.BytesIO(data), 0, len(data), "log")


def test_a_cut_inside_a_frames_prefix_reports_exactly_the_missing_prefix_bytes() -> None:
    frame = encode_frame(b"x" * 20)
    for cut in range(1, PREFIX_SIZE):
        torn = _read(frame[:cut])
        assert isinstance(torn, TornTail)
        assert torn.missing_bytes == PREFIX_SIZE - cut, f"cut after {cut} bytes: {torn}"
        assert torn.reason == f"incomplete frame prefix ({cut} of {PREFIX_SIZE} bytes)"
    torn = _read(frame[: PREFIX_SIZE + 5])
    assert isinstance(torn, TornTail) and torn.missing_bytes == 15  # (in the payload: exact)
