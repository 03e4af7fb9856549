"""Inputs: the facts that come from outside the scheduler (clients, the executor, the KV
store). Replay feeds them back in."""

from __future__ import annotations

import msgspec
import numpy as np

from kvsched.events.base import Event, MultimodalSpan


class RequestArrived(Event, frozen=True, tag="arrived"):
    seq_id: int
    prompt: np.ndarray  # int32 token ids (for a session turn: the new tokens only)
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0
    session_id: int = -1
    adapter: str = ""
    cache_salt: str = ""
    eos_token_id: int = -1
    temperature: float = 0.0
    seed: int = 0
    mm_spans: tuple[MultimodalSpan, ...] = ()
    return_routed_experts: bool = False
    # The caller's digests of the sequence's first full blocks (16 bytes each, e.g. vLLM's
    # Request.block_hashes): used instead of computing them (identity.py). Empty: computed.
    block_hashes: bytes = b""
    # The recorded future (only a trace replay under the "oracle" checkpoint rules fills it,
    # replay/future.py): (depth, next user) pairs, depths ascending: after ``depth`` prompt
    # tokens (whole blocks) this request's state is where the hit of request ``next user``
    # (a later request's id) will end. Empty: no known future.
    reuse: tuple[tuple[int, int], ...] = ()
    # Read no cached prefix (local or from the store): the prompt is computed whole, as
    # vLLM's ``skip_reading_prefix_cache`` (set for prompt logprobs); its blocks are still
    # cached for others. A field with a default, omitted at it (no schema change).
    skip_prefix_hit: bool = False


class RequestAborted(Event, frozen=True, tag="aborted"):
    seq_id: int
    reason: str = "client abort"


class SessionEnded(Event, frozen=True, tag="session_end"):
    session_id: int


SLEEP_LEVELS = (1, 2)  # 1: the executor releases its KV cache; 2: its weights too


class DrainRequested(Event, frozen=True, tag="drain"):
    """Release everything held (sleep); no admissions until ``WakeRequested``. ``level``
    (``SLEEP_LEVELS``): what the executor releases once drained (``Drained.level``)."""

    level: int = 1


class WakeRequested(Event, frozen=True, tag="wake"):
    pass


class AdmissionsHeld(Event, frozen=True, tag="hold"):
    """``held``: admit nothing from the waiting queue until ``AdmissionsHeld(held=False)``;
    running sequences, and loads already admitted, go on (vLLM's ``PAUSED_NEW``).
    ``running`` (with ``held``): what runs is held too, so nothing is scheduled at all
    (vLLM's ``PAUSED_ALL``). Each hold replaces the one before."""

    held: bool = True
    running: bool = False


class StepExecuted(Event, frozen=True, tag="executed"):
    """Outcome of a step: the tokens sampled for the sequences that sampled.

    Speculative decoding (fields with defaults, omitted when unused): ``counts[i]`` is how
    many tokens sequence ``seq_ids[i]`` produced (its accepted drafts and one more; empty:
    one each: None), ``tokens`` holds them in that order. ``draft_counts[i]`` draft tokens are
    proposed for its next step, the ``drafts`` in that order (None: none)."""

    step: int
    seq_ids: np.ndarray  # int64
    tokens: np.ndarray  # int32
    duration_s: float = 0.0
    # MoE: routed-expert ids of every computed token, in plan token order, flattened
    # [num_tokens * routed_experts_per_token] (int16); empty when not recorded.
    routed_experts: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int16))
    counts: np.ndarray | None = None  # int32
    draft_counts: np.ndarray | None = None  # int32
    drafts: np.ndarray | None = None  # int32


class StepFailed(Event, frozen=True, tag="step_failed"):
    """The executor raised while running a step's plan."""

    step: int
    reason: str


class KVLookupAnswered(Event, frozen=True, tag="kv_lookup"):
    """The store holds the chain up to ``num_blocks`` (``pending``: not known yet).
    ``sync_load``: a load of it runs within the step that starts it (``KVLoadStarted``'s
    ``synchronous``: vLLM's synchronous connectors)."""

    seq_id: int
    num_blocks: int
    pending: bool = False
    sync_load: bool = False


class KVLoadFinished(Event, frozen=True, tag="kv_load_done"):
    seq_id: int


class KVLoadFailed(Event, frozen=True, tag="kv_load_failed"):
    seq_id: int
    num_good_blocks: int
    reason: str


class KVSaveFinished(Event, frozen=True, tag="kv_save_done"):
    save_id: int
    ok: bool = True


class KVHoldRequested(Event, frozen=True, tag="kv_hold"):
    """A serving engine's KV connector keeps the sequence's first ``num_blocks`` blocks (its
    computed tokens, a partial last block too) for a transfer of its own, past the
    sequence's end, until ``KVHoldReleased`` (vLLM: ``request_finished`` delaying the free)."""

    seq_id: int
    num_blocks: int


class KVHoldReleased(Event, frozen=True, tag="kv_hold_done"):
    """The connector's transfer of a held sequence's blocks ended: the hold is dropped."""

    seq_id: int
