"""FutureUses: the recorded future of a trace replay, for the "oracle" checkpoint rules.

An upper reference knows when each state will be used again. That knowledge enters only as
recorded input, so that a replay of the log makes the same choices: each arrival carries its
``reuse`` pairs (``RequestArrived.reuse``, filled by ``replay/future.py``): after ``depth``
prompt tokens, this request's state is where the hit of the later request ``next`` will end.
This owner folds them and answers two queries:

* ``hinted(seq_id, depth)``: the next user of the state ``seq_id`` reaches after ``depth``
  tokens (``NEVER`` for none); the placement saves where it is not ``NEVER``;
* ``next_use(ckpt_id)``: the next user of a live checkpoint: its producer's hint at its
  depth when reserved, then the hint of each sequence that restores it (that sequence knows
  who comes after it). A next user that was already admitted without it (it arrived before
  the checkpoint was published, or hit a shallower one) will not use it: ``NEVER``.

Ids are compared as arrival order: the replay driver numbers requests in arrival order.

State: the hints of live sequences, the sequences that arrived and were never admitted, the
highest id arrived, and each live checkpoint's next user and depth. Idle (never visited) unless
the config reads the future (``reads_future``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev

NEVER = 1 << 62  # the next use of a state no later request uses (farther than any request id)

__all__ = ["NEVER", "FutureUses", "reads_future", "reuse_error"]


def reads_future(config: SchedulerConfig) -> bool:
    """Whether ``config``'s checkpoint rules read the arrivals' recorded future (the oracle's:
    ``config.CHECKPOINT_POLICIES["oracle"]``)."""
    return config.hybrid and config.checkpoints.eviction == "oracle"


def reuse_error(reuse: tuple[tuple[int, int], ...], seq_id: int, tokens: int, bs: int) -> str:
    """Why an arrival's ``reuse`` pairs are malformed for a request ``seq_id`` of ``tokens``
    tokens under block size ``bs`` ("" when they are well-formed)."""
    last = 0
    for pair in reuse:
        if len(pair) != 2:
            return "reuse must hold (depth, next request id) pairs"
        depth, user = pair
        if depth <= last or depth % bs or depth > tokens:
            return (
                f"reuse depth {depth}: depths must ascend, be whole blocks of {bs} and lie "
                f"inside the request's {tokens} tokens"
            )
        if user <= seq_id:
            return f"reuse next user {user}: must be a later request than {seq_id}"
        last = depth
    return ""


class FutureUses:
    def __init__(self) -> None:
        self.hints: dict[int, dict[int, int]] = {}  # live seq id -> {depth: next user}
        self.waiting: set[int] = set()  # arrived, never admitted (their uses are to come)
        self.last_arrival = -1  # the highest request id arrived
        self.next_of: dict[int, int] = {}  # live checkpoint id -> its next user
        self.depth_of: dict[int, int] = {}  # live checkpoint id -> its step

    def folds(self) -> dict[type[ev.Event], Callable[[Any], None]]:
        return {
            ev.RequestArrived: self._on_arrived,
            ev.RequestRejected: self._on_gone,
            ev.SequenceAdmitted: self._on_admitted,
            ev.SequenceFinished: self._on_finished,
            ev.SequenceAborted: self._on_gone,
            ev.CheckpointReserved: self._on_reserved,
            ev.CheckpointPinned: self._on_pinned,
            ev.CheckpointEvicted: self._on_dropped,
            ev.CheckpointReleased: self._on_dropped,
            ev.CheckpointAbandoned: self._on_dropped,
        }

    # ------------------------------------------------------------------------ queries

    def hinted(self, seq_id: int, depth: int) -> int:
        """The next user of ``seq_id``'s state after ``depth`` tokens (NEVER: none)."""
        return self.hints.get(seq_id, {}).get(depth, NEVER)

    def depths(self, seq_id: int) -> list[int]:
        """The depths where a later request's hit ends in ``seq_id``'s prompt, ascending."""
        return sorted(self.hints.get(seq_id, ()))

    def next_use(self, ckpt_id: int) -> int:
        """The request that will next restore a live checkpoint (NEVER: none will)."""
        return self.pending_use(self.next_of.get(ckpt_id, NEVER))

    def pending_use(self, user: int) -> int:
        """``user`` as a next use: itself while it has not been admitted, else NEVER."""
        return user if user > self.last_arrival or user in self.waiting else NEVER

    # -------------------------------------------------------------------------- folds

    def _on_arrived(self, e: ev.RequestArrived) -> None:
        if e.reuse:
            self.hints[e.seq_id] = dict(e.reuse)
        self.waiting.add(e.seq_id)
        self.last_arrival = max(self.last_arrival, e.seq_id)

    def _on_admitted(self, e: ev.SequenceAdmitted) -> None:
        self.waiting.discard(e.seq_id)

    def _on_gone(self, e: ev.RequestRejected | ev.SequenceAborted) -> None:
        self.waiting.discard(e.seq_id)
        self.hints.pop(e.seq_id, None)

    def _on_finished(self, e: ev.SequenceFinished) -> None:
        for seq_id in e.seq_ids.tolist():
            self.waiting.discard(seq_id)
            self.hints.pop(seq_id, None)

    def _on_reserved(self, e: ev.CheckpointReserved) -> None:
        self.next_of[e.ckpt_id] = self.hinted(e.seq_id, e.num_tokens)
        self.depth_of[e.ckpt_id] = e.num_tokens

    def _on_pinned(self, e: ev.CheckpointPinned) -> None:
        self.next_of[e.ckpt_id] = self.hinted(e.seq_id, self.depth_of[e.ckpt_id])

    def _on_dropped(
        self, e: ev.CheckpointEvicted | ev.CheckpointReleased | ev.CheckpointAbandoned
    ) -> None:
        self.next_of.pop(e.ckpt_id, None)
        self.depth_of.pop(e.ckpt_id, None)

    def check_invariants(self, live_ckpts: set[int]) -> str | None:
        """``live_ckpts``: the checkpoint table's live ids. None when consistent, else the
        first violation."""
        if set(self.next_of) != live_ckpts or set(self.depth_of) != live_ckpts:
            return "the recorded future does not know exactly the live checkpoints"
        if self.waiting and max(self.waiting) > self.last_arrival:
            return "a sequence waits for admission that never arrived"
        return None

    def snapshot(self) -> tuple[object, ...]:
        return (
            tuple(sorted((s, tuple(sorted(h.items()))) for s, h in self.hints.items())),
            tuple(sorted(self.waiting)),
            self.last_arrival,
            tuple(sorted(self.next_of.items())),
            tuple(sorted(self.depth_of.items())),
        )
