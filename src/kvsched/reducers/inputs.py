"""Input validation: every input of a step is checked before anything is folded.

``validate_inputs(state, inputs)`` returns the inputs in the order they are applied, or
raises an ``InputError`` naming the offending input, and never changes the state:

1. Only input events are inputs (a decision type such as ``BlocksAllocated``, or anything that
   is not an event, is ``NotAnInput``).
2. Every field has its declared type and a value the codec can encode and the state can
   hold: integers within int64, finite floats, 1-D integer arrays (``MalformedInput``).
3. An executor outcome answers the step that ran: ``StepExecuted`` / ``StepFailed`` of the
   pending step, exactly one per step that scheduled work (``OutcomeMismatch``); the sampled
   ids are exactly the sequences that sample, once each, with one in-vocabulary token each
   and, for MoE, one set of expert ids per computed token.
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
    ev.StepExecuted: 0,
    ev.StepFailed: 0,
    ev.KVLookupAnswered: 1,
    ev.KVLoadFinished: 1,
    ev.KVLoadFailed: 1,
    ev.KVSaveFinished: 1,
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
    """Outcomes, then transfer reports, then client requests; stable within each class."""
    return [e for _, e in _ordered(list(enumerate(inputs)))]


def _ordered(indexed: list[tuple[int, ev.Event]]) -> list[tuple[int, ev.Event]]:
    return sorted(indexed, key=lambda p: (_RANK.get(type(p[1]), _CLIENT_RANK), p[0]))


def validate_inputs(state: Owners, inputs: Sequence[ev.Event]) -> list[ev.Event]:
    for i, event in enumerate(inputs):
        if not isinstance(event, ev.INPUT_TYPES) or type(event) not in _FIELDS:
            raise NotAnInput(i, event, "not an input event (inputs: " + _INPUT_NAMES + ")")
        reason = _check_fields(event)
        if reason is not None:
            raise MalformedInput(i, event, reason)
    ordered = _ordered(list(enumerate(inputs)))
    _check_against_state(state, ordered, len(inputs))
    return [e for _, e in ordered]


# ----------------------------------------------------------------------- field types

_INPUT_NAMES = ", ".join(t.__name__ for t in ev.INPUT_TYPES)
_FIELDS: dict[type[ev.Event], tuple[tuple[str, Any], ...]] = {
    kind: tuple((f.name, f.type) for f in msgspec.structs.fields(kind)) for kind in ev.INPUT_TYPES
}


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
    if kind is np.ndarray:
        if not isinstance(value, np.ndarray) or value.ndim != 1:
            return f"{name} must be a 1-D numpy array"
        return None if value.dtype.kind in "iu" else f"{name} must hold integers, not {value.dtype}"
    return _check_spans(name, value)


def _check_spans(name: str, value: object) -> str | None:
    if not isinstance(value, tuple) or not all(isinstance(s, ev.MultimodalSpan) for s in value):
        return f"{name} must be a tuple of MultimodalSpan"
    for span in value:
        for field, kind in (("start", int), ("end", int), ("content_hash", bytes)):
            reason = _check_value(f"{name}.{field}", kind, getattr(span, field))
            if reason is not None:
                return reason
    return None


_F32_MAX = float(np.finfo(np.float32).max)


def _kind(typ: Any) -> Any:
    """A field's declared type as checked: ``tuple`` for a tuple of spans."""
    return tuple if getattr(typ, "__origin__", None) is tuple else typ


_KINDS: dict[type[ev.Event], tuple[tuple[str, Any], ...]] = {
    kind: tuple((name, _kind(typ)) for name, typ in fields) for kind, fields in _FIELDS.items()
}


def _check_fields(event: ev.Event) -> str | None:
    for name, kind in _KINDS[type(event)]:
        value = getattr(event, name)
        if type(value) is kind:  # the common case, checked here: the declared type exactly
            if kind is int:
                ok = -_I64 <= value < _I64
            elif kind is float:
                ok = math.isfinite(value)
            elif kind is str:
                ok = value.isascii()
            elif kind is np.ndarray:
                ok = value.ndim == 1 and value.dtype.kind in "iu"
            else:
                ok = kind is not tuple or not value  # bool, bytes; an empty tuple of spans
            if ok:
                continue
        reason = _check_value(name, kind, value)
        if reason is not None:
            return reason
    if isinstance(event, ev.RequestArrived) and abs(event.temperature) > _F32_MAX:
        return f"temperature={event.temperature} does not fit the sampling parameters (float32)"
    if isinstance(event, ev.RequestArrived) and len(event.block_hashes) % ev.HASH_SIZE:
        return f"block_hashes must be whole {ev.HASH_SIZE}-byte digests"
    if isinstance(event, ev.DrainRequested) and event.level not in ev.SLEEP_LEVELS:
        return f"level must be 1 (release the KV cache) or 2 (and the weights), got {event.level}"
    return None


# ----------------------------------------------------------------- against the state


def _check_against_state(state: Owners, ordered: list[tuple[int, ev.Event]], count: int) -> None:
    """Check the ordered inputs against the state as it would be when each is applied: one
    outcome of the pending step, transfer reports of transfers in flight, each once."""
    seqs = state.seqs
    answered = False  # the pending step's outcome has been given
    loads_done: set[int] = set()
    saves_done: set[int] = set()
    for i, event in ordered:
        if isinstance(event, (ev.StepExecuted, ev.StepFailed)):
            if answered or not seqs.has_pending:
                raise OutcomeMismatch(
                    i, event, f"no step awaits an outcome (step {event.step} given)"
                )
            if event.step != seqs.pending_step:
                raise OutcomeMismatch(
                    i, event, f"outcome of step {event.step}, but step {seqs.pending_step} ran"
                )
            answered = True
            reason = _sampled(state, event) if isinstance(event, ev.StepExecuted) else None
            if reason is not None:
                raise OutcomeMismatch(i, event, reason)
        elif isinstance(event, (ev.KVLoadFinished, ev.KVLoadFailed)):
            load = state.transfers.load_of(event.seq_id)
            if load is None or not load.in_flight or event.seq_id in loads_done:
                raise UnknownTransfer(i, event, f"sequence {event.seq_id} has no load in flight")
            if isinstance(event, ev.KVLoadFailed) and event.num_good_blocks < 0:
                raise MalformedInput(i, event, "num_good_blocks must be >= 0")
            loads_done.add(event.seq_id)
        elif isinstance(event, ev.KVSaveFinished):
            if event.save_id not in state.transfers.leases or event.save_id in saves_done:
                raise UnknownTransfer(i, event, f"save {event.save_id} is not in flight")
            saves_done.add(event.save_id)
        elif isinstance(event, ev.KVLookupAnswered) and event.num_blocks < 0:
            raise MalformedInput(i, event, "num_blocks must be >= 0")
    if seqs.has_pending and not answered:
        raise OutcomeMismatch(
            count,
            None,
            f"the outcome of step {seqs.pending_step} (StepExecuted or StepFailed) is missing: "
            "every step that scheduled work needs one",
        )


def _sampled(state: Owners, e: ev.StepExecuted) -> str | None:
    """Why the sampled ids, tokens, duration or expert ids do not answer the pending step."""
    seqs, model = state.seqs, state.config.model
    expected = seqs.sampling_seq_ids()
    if len(e.tokens) != len(e.seq_ids):
        return f"{len(e.tokens)} tokens for {len(e.seq_ids)} sequences"
    if not np.array_equal(e.seq_ids, expected):  # (the plan's order: the common case)
        if len(np.unique(e.seq_ids)) != len(e.seq_ids):
            return "a sequence id appears twice"
        if not np.array_equal(np.sort(e.seq_ids), np.sort(expected)):
            extra = sorted(set(e.seq_ids.tolist()) ^ set(expected.tolist()))[:8]
            return f"sampled ids differ from the sequences that sample (differ: {extra})"
    if len(e.tokens) and (e.tokens.min() < 0 or e.tokens.max() >= model.vocab_size):
        return f"a sampled token is outside the vocabulary [0, {model.vocab_size})"
    if not math.isfinite(e.duration_s) or e.duration_s < 0:
        return f"duration_s must be finite and >= 0, got {e.duration_s}"
    k = model.routed_experts_per_token
    experts = e.routed_experts
    if len(experts):
        _, starts, ends = seqs.pending_arrays()
        want = int((ends - starts).sum()) * k
        if not k or len(experts) != want:
            return f"{len(experts)} routed-expert ids, expected {want} or none"
        if experts.min() < 0 or experts.max() > np.iinfo(np.int16).max:
            return "a routed-expert id is outside [0, 32767]"
    return None
