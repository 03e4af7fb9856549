"""Stats: the engine's counters, folded from events (requests, hits, tokens, preemptions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvsched.events import types as ev
from kvsched.reducers.errors import RefChange

# What an event counts: one, its sequences, or the tokens it schedules (ends - starts).
_ONE, _SEQUENCES, _TOKENS = "one", "sequences", "tokens"

# event type -> (the counter it adds to, what it adds)
COUNTS: dict[type[ev.Event], tuple[str, str]] = {
    ev.StepStarted: ("steps", _ONE),
    ev.RequestArrived: ("requests_arrived", _ONE),
    ev.RequestRejected: ("requests_rejected", _ONE),
    ev.StepExecuted: ("generated_tokens", _SEQUENCES),
    ev.PrefillScheduled: ("prefill_tokens", _TOKENS),
    ev.DecodeScheduled: ("decode_tokens", _SEQUENCES),
    ev.SequencePreempted: ("preemptions", _ONE),
    ev.SequenceFinished: ("requests_finished", _SEQUENCES),
    ev.SequenceAborted: ("requests_aborted", _ONE),
}


@attrs.define(slots=True)
class Stats:
    block_size: int = 64
    requests_arrived: int = 0
    requests_rejected: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    ckpt_hit_tokens: int = 0  # hybrid: hits restored from a checkpoint
    kv_only_hit_tokens: int = 0  # hybrid: cached KV unusable for lack of a checkpoint
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    external_hit_tokens: int = 0  # prompt tokens admitted to be loaded from the store

    def folds(self) -> dict[type[ev.Event], Callable[[Any], RefChange | None]]:
        folds: dict[type[ev.Event], Callable[[Any], RefChange | None]]
        folds = dict.fromkeys(COUNTS, self._count)
        folds[ev.PrefixMatched] = self._on_matched
        folds[ev.KVLoadAdmitted] = self._on_load_admitted
        return folds

    def _count(self, e: Any) -> None:
        """Add what ``e`` counts to its type's counter (``COUNTS``)."""
        counter, measure = COUNTS[type(e)]
        if measure is _ONE:
            n = 1
        elif measure is _SEQUENCES:
            n = len(e.seq_ids)
        else:  # _TOKENS
            n = int((e.ends - e.starts).sum())
        setattr(self, counter, getattr(self, counter) + n)

    def _on_matched(self, e: ev.PrefixMatched) -> None:
        if e.num_query_tokens:  # re-admissions after preemption are not counted
            self.query_tokens += e.num_query_tokens
            self.hit_tokens += e.num_tokens
            if e.ckpt_id >= 0:
                self.ckpt_hit_tokens += e.num_tokens
            if e.kv_hit_tokens > e.num_tokens:
                self.kv_only_hit_tokens += e.kv_hit_tokens - e.num_tokens

    def _on_load_admitted(self, e: ev.KVLoadAdmitted) -> None:
        self.external_hit_tokens += (e.num_blocks - e.first_block) * self.block_size
