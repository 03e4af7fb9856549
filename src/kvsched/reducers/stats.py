"""Stats: the engine's counters, folded from events (requests, hits, tokens, preemptions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvsched.events import types as ev
from kvsched.reducers.errors import RefChange


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
        return {
            ev.StepStarted: self._on_step_started,
            ev.RequestArrived: self._on_arrived,
            ev.RequestRejected: self._on_rejected,
            ev.StepExecuted: self._on_executed,
            ev.PrefixMatched: self._on_matched,
            ev.PrefillScheduled: self._on_prefill,
            ev.DecodeScheduled: self._on_decode,
            ev.SequencePreempted: self._on_preempted,
            ev.SequenceFinished: self._on_finished,
            ev.SequenceAborted: self._on_aborted,
            ev.KVLoadAdmitted: self._on_load_admitted,
        }

    def _on_step_started(self, e: ev.StepStarted) -> None:
        self.steps += 1

    def _on_arrived(self, e: ev.RequestArrived) -> None:
        self.requests_arrived += 1

    def _on_rejected(self, e: ev.RequestRejected) -> None:
        self.requests_rejected += 1

    def _on_executed(self, e: ev.StepExecuted) -> None:
        self.generated_tokens += len(e.seq_ids)

    def _on_matched(self, e: ev.PrefixMatched) -> None:
        if e.num_query_tokens:  # re-admissions after preemption are not counted
            self.query_tokens += e.num_query_tokens
            self.hit_tokens += e.num_tokens
            if e.ckpt_id >= 0:
                self.ckpt_hit_tokens += e.num_tokens
            if e.kv_hit_tokens > e.num_tokens:
                self.kv_only_hit_tokens += e.kv_hit_tokens - e.num_tokens

    def _on_prefill(self, e: ev.PrefillScheduled) -> None:
        self.prefill_tokens += int((e.ends - e.starts).sum())

    def _on_decode(self, e: ev.DecodeScheduled) -> None:
        self.decode_tokens += len(e.seq_ids)

    def _on_preempted(self, e: ev.SequencePreempted) -> None:
        self.preemptions += 1

    def _on_finished(self, e: ev.SequenceFinished) -> None:
        self.requests_finished += len(e.seq_ids)

    def _on_aborted(self, e: ev.SequenceAborted) -> None:
        self.requests_aborted += 1

    def _on_load_admitted(self, e: ev.KVLoadAdmitted) -> None:
        self.external_hit_tokens += (e.num_blocks - e.first_block) * self.block_size
