"""Shared vocabulary of the policy's parts: the emit hook, a tentative match, a chunk, the
step's prefill budget, and a small arithmetic helper."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import attrs
import numpy as np

from kvsched.events import types as ev

Emit = Callable[[ev.Event], None]
I32, I64 = np.int32, np.int64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Match(NamedTuple):
    """A tentative prefix match: tokens served, their blocks, the checkpoint to restore."""

    num_tokens: int
    blocks: np.ndarray
    ckpt_id: int = -1
    kv_tokens: int = -1  # hybrid: what the KV cache alone matched
    # MTP: the cached block after the hit, which the sequence recomputes into a private block
    # while it holds this one (0: none)
    overlap: int = 0


NO_MATCH = Match(0, np.zeros(0, dtype=np.int32))


class Chunk(NamedTuple):
    """Tokens [start, end) of a prefill; ``final``: it ends the prompt."""

    start: int
    end: int
    final: bool


@attrs.define(slots=True)
class StepBudget:
    """What this step has committed so far (``Admission.add_prefill`` counts each chunk)."""

    busy: bool = False  # decode work is scheduled this step
    long_prefills: bool = True  # the turn lets long prefills run (policy/turns.py)
    tokens: int = 0
    encoder_tokens: int = 0  # multimodal span positions the step's chunks embed
    prefills: int = 0
    long_chunks: int = 0
    seq_ids: list[int] = attrs.field(factory=list)
    starts: list[int] = attrs.field(factory=list)
    ends: list[int] = attrs.field(factory=list)
