"""Seq: one request's tokens, identity, lifecycle state and admission statistics; History: a
session's finished turns."""

from __future__ import annotations

import attrs
import numpy as np

from kvsched.events import types as ev
from kvsched.identity import HashChain
from kvsched.statemachines import SeqState

FREE_ROW = -1
NO_BLOCKS = np.zeros(0, dtype=np.int32)
NO_BLOCKS.flags.writeable = False


@attrs.define(slots=True, eq=False)
class Seq:
    seq_id: int
    tokens: np.ndarray  # int32, capacity >= n_tokens
    n_tokens: int
    n_prompt: int  # tokens before this turn's first output
    max_tokens: int
    arrival_time: float
    priority: int = 0
    session_id: int = -1
    adapter: str = ""
    cache_salt: str = ""
    eos_token_id: int = -1
    temperature: float = 0.0
    seed: int = 0
    mm_spans: tuple[ev.MultimodalSpan, ...] = ()
    root: bytes = b""
    hashes: HashChain = attrs.field(factory=HashChain)
    state: SeqState = SeqState.WAITING
    row: int = FREE_ROW
    want_experts: bool = False  # the request asked for its routed-expert ids
    skip_hit: bool = False  # it reads no cached prefix (RequestArrived.skip_prefix_hit)
    experts: np.ndarray | None = None  # [capacity, K] int16 routed-expert ids per token
    n_experts: int = 0  # leading tokens whose expert ids are known
    pinned_ckpt: int = -1  # hybrid: checkpoint restored at admission, pinned while running
    n_pinned: int = 0  # leading blocks of the block table covered by that pin (no own refs)
    # MTP: the cached block of chain index overlap_at that the sequence recomputed into the
    # private block of its block table there; it holds a reference on the cached one (0: none)
    overlap_block: int = 0
    overlap_at: int = -1
    num_failures: int = 0  # consecutive failed steps that computed this sequence
    num_preemptions: int = 0
    preempted_at: int = -1  # the step of the latest preemption
    finish_reason: str = ""
    num_hit_tokens: int = 0  # prefix-match statistics of the latest admission
    # hybrid: the cached KV prefix found at the latest admission (past num_hit_tokens when
    # no state was kept where that prefix ends: a branch point)
    kv_hit_tokens: int = 0
    # Prompt tokens the first admission did not compute (vLLM's num_cached_tokens), by
    # source: a local KV prefix hit, a restored checkpoint (hybrid), an external load.
    cached_local: int = 0
    cached_checkpoint: int = 0
    cached_external: int = 0

    @property
    def n_output(self) -> int:
        return self.n_tokens - self.n_prompt

    @property
    def cached_tokens(self) -> tuple[int, int, int]:
        """(local, checkpoint, external) prompt tokens its first admission did not compute."""
        return (self.cached_local, self.cached_checkpoint, self.cached_external)

    def record_experts(self, start: int, ids: np.ndarray) -> None:
        """Expert ids of tokens [start, start + len(ids)); kept only while contiguous."""
        if start > self.n_experts:
            return
        end = start + len(ids)
        if self.experts is None or len(self.experts) < end:
            cap = max(end, 64, 2 * (0 if self.experts is None else len(self.experts)))
            grown = np.zeros((cap, ids.shape[1]), dtype=np.int16)
            if self.experts is not None:
                grown[: self.n_experts] = self.experts[: self.n_experts]
            self.experts = grown
        self.experts[start:end] = ids
        self.n_experts = max(self.n_experts, end)

    def token_view(self) -> np.ndarray:
        return self.tokens[: self.n_tokens]


@attrs.frozen
class History:
    """A session's history: every token of its finished turns, their full-block hash chain,
    the namespace root it chains from, and the multimodal spans it contains."""

    tokens: np.ndarray
    hashes: HashChain
    root: bytes
    spans: tuple[ev.MultimodalSpan, ...]
