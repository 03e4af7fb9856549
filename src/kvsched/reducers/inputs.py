"""Input validation: every input of a step is checked before anything is folded.

``validate_inputs(state, inputs)`` returns the inputs in the order they are applied, or
raises an ``InputError`` naming the offending input, and never changes the state:

1. Only input events are inputs (a decision type such as ``BlocksAllocated``, or anything that
   is not an event, is ``NotAnInput``).
2. Every field has its declared type and a value the codec can encode and the state can
   hold: integers within int64, finite floats, 1-D integer arrays (``MalformedInput``).
3. An executor outcome answers the step that ran: ``StepExecuted`` / ``StepFailed`` of the
   pending step, exactly one per step that scheduled work (``OutcomeMismatch``; overlapped
   steps: the launched steps' outcomes oldest first, the newest's by the step after next);
   the sampled ids are exactly the sequences that sample, once each, with one in-vocabulary
   token each and, for MoE, one set of expert ids per computed token.
4. A transfer report concerns a transfer in flight: a load outcome a sequence whose load is
   loading, a save outcome a save not yet answered, each at most once (``UnknownTransfer``).

Requests that are well-formed but unacceptable (an empty prompt, an unknown token id, a
duplicate id, a prompt the cache cannot hold) are not input errors: the policy rejects them
with a ``RequestRejected`` decision, which the log records.

Order: executor outcomes first, then transfer reports, then client requests (arrivals,
aborts, ends of session, drain, wake) in the order given. So an abort given before the
outcome of its sequence's step is applied after it, and the outcome never meets a freed row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
from msgspec.structs import astuple

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.reducers.sequences import SequenceTable
from kvsched.reducers.transfers import TransferTable


class Owners(Protocol):
    """What the validation reads: the config, the pending work, the transfers in flight."""

    @property
    def config(self) -> SchedulerConfig: ...

    @property
    def seqs(self) -> SequenceTable: ...

    @property
    def transfers(self) -> TransferTable: ...


__all__ = [
    "InputError",
    "MalformedInput",
    "NotAnInput",
    "OutcomeMismatch",
    "UnknownTransfer",
    "apply_order",
    "validate_inputs",
]

_I64 = 1 << 63

_RANK: dict[type[ev.Event], int] = {
    # a connector's hold first: the outcome's fold may retire the sequence it holds
    ev.KVHoldRequested: -1,
    ev.StepExecuted: 0,
    ev.StepFailed: 0,
    ev.KVLookupAnswered: 1,
    ev.KVLoadFinished: 1,
    ev.KVLoadFailed: 1,
    ev.KVSaveFinished: 1,
    ev.KVHoldReleased: 1,
}
_CLIENT_RANK = 2


class InputError(ValueError):
    """An input the engine refuses; the step is rejected and the state is unchanged."""

    def __init__(self, index: int, event: object, reason: str) -> None:
        self.index = index
        self.event = event
        self.reason = reason
        name = type(event).__name__
        super().__init__(f"input #{index} ({name}): {reason}")


class NotAnInput(InputError):
    """Something that is not an input event (a decision, or not an event at all)."""


class MalformedInput(InputError):
    """A field of the wrong type, or a value the log cannot encode or the state cannot hold."""


class OutcomeMismatch(InputError):
    """An executor outcome that does not answer the step that ran."""


class UnknownTransfer(InputError):
    """A transfer report for no transfer in flight (or a second report of one)."""


def apply_order(inputs: Sequence[ev.Event]) -> list[ev.Event]:
    """Connector holds, outcomes, transfer reports, then client requests; stable within each
    class."""
    return sorted(inputs, key=lambda e: _RANK.get(type(e), _CLIENT_RANK))


def validate_inputs(state: Owners, inputs: Sequence[ev.Event]) -> list[ev.Event]:
    """The inputs in the order they are applied (``apply_order``), once each is an input
    whose fields are well-formed (rules 1 and 2, in the order given) and they agree with
    the state (rules 3 and 4, in the order applied); else the ``InputError`` of the first
    that fails."""
    ranks: list[int] = []
    for i, event in enumerate(inputs):
        kind = type(event)
        kinds = _EXACT.get(kind)
        if kinds is None:
            raise NotAnInput(i, event, "not an input event (inputs: " + _INPUT_NAMES + ")")
        ranks.append(_RANK.get(kind, _CLIENT_RANK))
        # The common case, checked here: every field exactly of its declared type, in range.
        for declared, value in zip(kinds, astuple(event), strict=True):
            if declared is _OptionalArray:
                if value is None or (
                    type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu"
                ):
                    continue
                break
            if type(value) is not declared or not (
                -_I64 <= value < _I64 if declared is int
                else math.isfinite(value) if declared is float
                else value.isascii() if declared is str
                else value.ndim == 1 and value.dtype.kind in "iu" if declared is np.ndarray
                else declared is not tuple or not value  # (bool, bytes; spans: none)
            ):
                break
        else:
            if isinstance(event, ev.RequestArrived):
                whole = not len(event.block_hashes) % ev.HASH_SIZE
                if whole and abs(event.temperature) <= _F32_MAX:
                    continue
            elif not isinstance(event, ev.DrainRequested) or event.level in ev.SLEEP_LEVELS:
                continue
        reason = _field_error(event)
        if reason is not None:
            raise MalformedInput(i, event, reason)
    order = sorted(range(len(inputs)), key=ranks.__getitem__)
    _check_against_state(state, inputs, order)
    return [inputs[i] for i in order]


# ----------------------------------------------------------------------- field types

_INPUT_NAMES = ", ".join(t.__name__ for t in ev.INPUT_TYPES)


class _OptionalArray:
    """The checked kind of an ``np.ndarray | None`` field (None: the field is unused)."""


def _kind(typ: Any) -> Any:
    """A field's declared type as checked: ``tuple`` for a tuple of spans."""
    if getattr(typ, "__args__", None) == (np.ndarray, type(None)):
        return _OptionalArray
    return tuple if getattr(typ, "__origin__", None) is tuple else typ


# input type -> (name, type as checked) of each field, in declaration order
_KINDS: dict[type[ev.Event], tuple[tuple[str, Any], ...]] = {
    kind: tuple((f.name, _kind(f.type)) for f in msgspec.structs.fields(kind))
    for kind in ev.INPUT_TYPES
}
# input type -> the types alone, in the order of ``msgspec.structs.astuple``
_EXACT: dict[type[ev.Event], tuple[Any, ...]] = {
    kind: tuple(k for _, k in fields) for kind, fields in _KINDS.items()
}
_F32_MAX = float(np.finfo(np.float32).max)


def _field_error(event: ev.Event) -> str | None:
    """Why a field of ``event`` is malformed (the first, field by field in declaration
    order, then its type's own rules), or None."""
    for name, kind in _KINDS[type(event)]:
        reason = _check_value(name, kind, getattr(event, name))
        if reason is not None:
            return reason
    if isinstance(event, ev.RequestArrived) and abs(event.temperature) > _F32_MAX:
        return f"temperature={event.temperature} does not fit the sampling parameters (float32)"
    if isinstance(event, ev.RequestArrived) and len(event.block_hashes) % ev.HASH_SIZE:
        return f"block_hashes must be whole {ev.HASH_SIZE}-byte digests"
    if isinstance(event, ev.DrainRequested) and event.level not in ev.SLEEP_LEVELS:
        return f"level must be 1 (release the KV cache) or 2 (and the weights), got {event.level}"
    return None


def _check_value(name: str, kind: Any, value: object) -> str | None:
    if kind is bool:
        return None if isinstance(value, (bool, np.bool_)) else f"{name} must be a bool"
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            return f"{name} must be an integer, got {type(value).__name__}"
        return None if -_I64 <= int(value) < _I64 else f"{name}={value} does not fit in int64"
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            return f"{name} must be a number, got {type(value).__name__}"
        return None if math.isfinite(float(value)) else f"{name} must be finite, got {value}"
    if kind is str:
        if not isinstance(value, str):
            return f"{name} must be a str"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{name} is not valid UTF-8 text (a lone surrogate)"
        return None
    if kind is bytes:
        return None if isinstance(value, bytes) else f"{name} must be bytes"
    if kind is _OptionalArray:
        return None if value is None else _check_value(name, np.ndarray, value)
    if kind is np.ndarray:
        if not isinstance(value, np.ndarray) or value.ndim != 1:
            return f"{name} must be a 1-D numpy array"
        return None if value.dtype.kind in "iu" else f"{name} must hold integers, not {value.dtype}"
    if name == "reuse":
        return _check_reuse(name, value)
    return _check_spans(name, value)


def _check_reuse(name: str, value: object) -> str | None:
    """A recorded future: a tuple of (depth, next request id) integer pairs."""
    if not isinstance(value, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 for p in value
    ):
        return f"{name} must be a tuple of (depth, next request id) pairs"
    for pair in value:
        for part in pair:
            reason = _check_value(f"{name} entry", int, part)
            if reason is not None:
                return reason
    return None


def _check_spans(name: str, value: object) -> str | None:
    if not isinstance(value, tuple) or not all(isinstance(s, ev.MultimodalSpan) for s in value):
        return f"{name} must be a tuple of MultimodalSpan"
    for span in value:
        for field, kind in (("start", int), ("end", int), ("content_hash", bytes)):
            reason = _check_value(f"{name}.{field}", kind, getattr(span, field))
            if reason is not None:
                return reason
    return None


# ----------------------------------------------------------------- against the state


def _check_against_state(state: Owners, inputs: Sequence[ev.Event], order: list[int]) -> None:
    """Check the inputs, in the order they are applied, against the state as each finds it:
    one outcome of the pending step, whose sampled ids are exactly the sequences that sample
    (once each, one in-vocabulary token each), with a finite duration and, for MoE, one set
    of expert ids per computed token; transfer reports of transfers in flight, each once; a
    connector's hold of a live sequence's blocks, once, and its release of a hold."""
    seqs, model = state.seqs, state.config.model
    owed = seqs.awaiting_outcomes  # (step, sampler ids), oldest first
    answered = 0  # outcomes given, of the owed steps in order
    loads_done: set[int] = set()
    saves_done: set[int] = set()
    holds: set[int] = set()  # (asked in these inputs)
    released: set[int] = set()
    for i in order:
        e = inputs[i]
        if type(e) not in _RANK:
            break  # (client requests come last and are not checked against the state)
        if isinstance(e, (ev.StepExecuted, ev.StepFailed)):
            if answered == len(owed):
                raise OutcomeMismatch(i, e, f"no step awaits an outcome (step {e.step} given)")
            step, expected, verifying = owed[answered]
            if e.step != step:
                raise OutcomeMismatch(i, e, f"outcome of step {e.step}, but step {step} ran")
            answered += 1
            if isinstance(e, ev.StepFailed):
                continue
            experts = e.routed_experts
            plain = e.counts is None and e.draft_counts is None and e.drafts is None
            odd = not plain or len(e.tokens) != len(e.seq_ids)
            reason = _speculation_error(e, expected, verifying) if odd else None
            if reason is not None or np.array_equal(e.seq_ids, expected):
                pass  # (the plan's order: the common case)
            elif len(np.unique(e.seq_ids)) != len(e.seq_ids):
                reason = "a sequence id appears twice"
            elif not np.array_equal(np.sort(e.seq_ids), np.sort(expected)):
                extra = sorted(set(e.seq_ids.tolist()) ^ set(expected.tolist()))[:8]
                reason = f"sampled ids differ from the sequences that sample (differ: {extra})"
            vocab = model.vocab_size
            for name, tokens in (("sampled token", e.tokens), ("draft token", e.drafts)):
                if reason is None and tokens is not None and len(tokens):  # noqa: SIM102
                    if tokens.min() < 0 or tokens.max() >= vocab:
                        reason = f"a {name} is outside the vocabulary [0, {vocab})"
            if reason is None and (not math.isfinite(e.duration_s) or e.duration_s < 0):
                reason = f"duration_s must be finite and >= 0, got {e.duration_s}"
            if reason is None and len(experts):
                _, starts, ends = seqs.pending_arrays()
                k = model.routed_experts_per_token
                want = int((ends - starts).sum()) * k
                if not k or len(experts) != want:
                    reason = f"{len(experts)} routed-expert ids, expected {want} or none"
                elif experts.min() < 0 or experts.max() > np.iinfo(np.int16).max:
                    reason = "a routed-expert id is outside [0, 32767]"
            if reason is not None:
                raise OutcomeMismatch(i, e, reason)
        elif isinstance(e, (ev.KVLoadFinished, ev.KVLoadFailed)):
            load = state.transfers.load_of(e.seq_id)
            if load is None or not load.in_flight or e.seq_id in loads_done:
                raise UnknownTransfer(i, e, f"sequence {e.seq_id} has no load in flight")
            if isinstance(e, ev.KVLoadFailed) and e.num_good_blocks < 0:
                raise MalformedInput(i, e, "num_good_blocks must be >= 0")
            loads_done.add(e.seq_id)
        elif isinstance(e, ev.KVSaveFinished):
            if e.save_id not in state.transfers.leases or e.save_id in saves_done:
                raise UnknownTransfer(i, e, f"save {e.save_id} is not in flight")
            saves_done.add(e.save_id)
        elif isinstance(e, ev.KVHoldRequested):
            seq = seqs.find(e.seq_id)
            if seq is None or e.seq_id in state.transfers.holds or e.seq_id in holds:
                raise UnknownTransfer(i, e, f"sequence {e.seq_id} is not live, or held already")
            if not 0 < e.num_blocks <= len(seqs.block_table(seq)):
                raise MalformedInput(i, e, f"sequence {e.seq_id} holds no {e.num_blocks} blocks")
            holds.add(e.seq_id)
        elif isinstance(e, ev.KVHoldReleased):
            held = e.seq_id in state.transfers.holds or e.seq_id in holds
            if not held or e.seq_id in released:
                raise UnknownTransfer(i, e, f"sequence {e.seq_id} is not held")
            released.add(e.seq_id)
        elif isinstance(e, ev.KVLookupAnswered) and e.num_blocks < 0:
            raise MalformedInput(i, e, "num_blocks must be >= 0")
    # (overlapped steps: the newest step's outcome may come one step later)
    if len(owed) - answered > int(seqs.pipelined):
        raise OutcomeMismatch(
            len(inputs),
            None,
            f"the outcome of step {owed[answered][0]} (StepExecuted or StepFailed) is missing: "
            "every step that scheduled work needs one"
            + (", at the latest in the step after next" if seqs.pipelined else ""),
        )


def _speculation_error(
    e: ev.StepExecuted, expected: np.ndarray, verifying: np.ndarray
) -> str | None:
    """Why the outcome's token and draft counts do not fit the step (None when they do):
    one token per sampler, or ``counts`` of them, each at least one and at most one more
    than the drafts its row verified (``verifying``, per ``expected`` sampler);
    ``draft_counts`` drafts proposed per sampler."""
    n = len(e.seq_ids)
    counts = e.counts
    if counts is None:
        if len(e.tokens) != n:
            return f"{len(e.tokens)} tokens for {n} sequences"
    elif len(counts) != n or int(counts.sum()) != len(e.tokens):
        return f"token counts {len(counts)} for {n} sequences, {len(e.tokens)} tokens"
    elif n and int(counts.min()) < 1:
        return "a sequence that sampled produced no token"
    elif n and int(counts.max()) > 1:
        most = dict(zip(expected.tolist(), (1 + verifying).tolist(), strict=True))
        pairs = zip(e.seq_ids.tolist(), counts.tolist(), strict=True)
        if any(c > most.get(s, 1) for s, c in pairs):
            return "a sequence produced more tokens than its verified drafts and one"
    if e.draft_counts is not None or e.drafts is not None:
        drafts, per = e.drafts, e.draft_counts
        if drafts is None or per is None or len(per) != n or int(per.sum()) != len(drafts):
            return "draft counts that do not match the sequences or the drafts"
        if n and int(per.min()) < 0:
            return "a negative draft count"
    return None

