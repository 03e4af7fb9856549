"""A built-in generated shape (``gen:NAME``, ``replay/shapes.py``) as a ``Trace``."""

from __future__ import annotations

from kvsched.replay.shapes import ChatBranching, chat_branching, token_ideal
from kvsched.replay.traces import GEN_PREFIX, Trace, TraceError, TraceInfo
from kvsched.replay.workload import Workload


def generated_trace(
    name: str, params: ChatBranching, seed: int, block_size: int, limit: int | None = None
) -> Trace:
    """The built-in shape ``gen:chat-branching`` (the only one) as a trace: its first
    ``limit`` requests, with their sequential ideal at ``block_size``."""
    if name != f"{GEN_PREFIX}chat-branching":
        raise TraceError(f"{name}: no such generated shape (known: {GEN_PREFIX}chat-branching)")
    workload = chat_branching(params, seed)
    turns = workload.turns[:limit] if limit is not None else workload.turns
    prompts = [t.request.prompt for t in turns]
    lengths = [len(t.request.prompt) + t.request.max_tokens for t in turns]
    info = TraceInfo(
        name,
        "gen",
        len(turns),
        len(turns),
        (),
        0,
        max(lengths),
        sum(lengths),
        token_ideal(prompts, block_size),
    )
    return Trace(Workload(workload.name, turns), info)
