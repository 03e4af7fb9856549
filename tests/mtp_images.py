"""What the property machines' MTP-and-images variants share: requests with multimodal spans
and an executor wrapper that checks no forward starts or ends inside one (issue 16, items 3
and 4). The variants subclass the machines and leave their source unchanged (a machine's
source seeds its derandomised examples, which the planted-bug checks rely on)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from kvsched.events import types as ev
from kvsched.plan import StepPlan
from kvsched.reducers.state import EngineState

# None, or (start, end, content) of one image in the first 8 prompt tokens (4-token blocks).
IMAGES = st.sampled_from([None, (1, 6, b"cat"), (3, 8, b"cat"), (3, 8, b"dog")])


def with_image(arrival: ev.Event, image: tuple[int, int, bytes] | None) -> ev.Event:
    """The arrival with ``image`` as its multimodal span (unchanged for None)."""
    if image is None:
        return arrival
    return msgspec.structs.replace(arrival, mm_spans=(ev.MultimodalSpan(*image),))


class SpansWhole:
    """An executor that first checks that no row of a plan starts or ends strictly inside a
    multimodal span of its sequence (chunks, hits, loads), then runs ``inner``."""

    def __init__(self, inner: Any, state: EngineState) -> None:
        self.inner = inner
        self.state = state

    def execute(self, plan: StepPlan) -> ev.StepExecuted:
        seqs = self.state.seqs.seqs
        for seq_id, start, end in zip(
            plan.seq_ids.tolist(), plan.starts.tolist(), plan.ends.tolist(), strict=True
        ):
            for span in seqs[seq_id].mm_spans:
                assert not span.start < start < span.end, f"{seq_id} starts in {span}"
                assert not span.start < end < span.end, f"{seq_id} ends in {span}"
        result: ev.StepExecuted = self.inner.execute(plan)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
