"""EngineState: the owners of the scheduler's state, and the dispatch of every event to them.

``apply(event)`` is the only way state changes. Each owner folds its own part of an event
(``owner.folds()`` maps event types to its handlers); ``apply`` calls the handlers of the
event's type in a fixed owner order and hands the reference changes a holder's handler
returns to the block pool. Nothing here folds anything itself: this class dispatches,
answers a few cross-owner queries, and checks the cross-owner invariants
(``reducers/invariants.py``).

Owner order: every event visits its owners in ``OWNER_ORDER``. The order is not free: an
owner that checks an event must fold it before the owners that act on it, and an owner that
reads another's data must fold before (or after) that owner changes it. Each such constraint
is declared, with its reason, in ``OWNER_AFTER`` (owner -> the owners it must follow); the
order is checked against them when this module is imported (``check_owner_order``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.reducers import invariants
from kvsched.reducers.blocks import BlockPool
from kvsched.reducers.checkpoints import CheckpointTable
from kvsched.reducers.errors import InvariantError, RefChange, ReplayMismatch
from kvsched.reducers.future import FutureUses, reads_future
from kvsched.reducers.holdings import LoadHoldings
from kvsched.reducers.sequences import Arrival, Seq, SequenceTable
from kvsched.reducers.sessions import SessionTable
from kvsched.reducers.stats import Stats
from kvsched.reducers.transfers import TransferTable
from kvsched.reducers.turns import Turns
from kvsched.reducers.work import Serving, StepWork

__all__ = ["EngineState", "InvariantError", "ReplayMismatch"]

OWNER_ORDER = (
    "serving", "transfers", "sessions", "seqs", "holdings", "ckpts", "pool", "work", "stats",
    "turns", "future",
)

# owner -> {owner it must fold after: why}. Everything the order must respect, and nothing else.
OWNER_AFTER: dict[str, dict[str, str]] = {
    "serving": {},
    "transfers": {},
    "sessions": {},
    "seqs": {
        "transfers": "transfers refuses a sequence that leaves while its load is in flight, "
        "before the sequence table retires it",
        "sessions": "sessions keeps an ending turn's tokens as the session's history, reading "
        "the sequence the sequence table then retires",
    },
    "holdings": {
        "seqs": "a rowless load settled into a row: the sequence table copies the blocks it "
        "held into the row before the holdings forget them",
    },
    "ckpts": {
        "seqs": "the sequence table checks that a checkpoint reserved, pinned or unpinned is its "
        "sequence's state before the checkpoint table records it",
    },
    "pool": {
        "ckpts": "a reservation reads its anchor's path from the prefix index before the pool "
        "takes the frozen copy of its partial block",
    },
    "work": {
        "seqs": "step work reads the row an admission or a settled load was given",
        "ckpts": "step work reads the slot of a checkpoint reserved or pinned",
    },
    "stats": {},
    "turns": {
        "seqs": "the turn reads the known tokens of the rows a prefill schedules, after the "
        "sequence table checked the chunk",
    },
    "future": {},
}


def check_owner_order(order: Sequence[str], after: dict[str, dict[str, str]]) -> None:
    """Raise TypeError if ``order`` does not name each declared owner once, or puts an owner
    before one it must follow (naming both and the reason)."""
    if sorted(order) != sorted(after) or len(set(order)) != len(order):
        raise TypeError(f"owner order {list(order)} does not name each owner of {sorted(after)}")
    position = {name: i for i, name in enumerate(order)}
    for owner, earlier in after.items():
        for first, why in earlier.items():
            if first not in position:
                raise TypeError(f"{owner} must follow {first}, which is no owner")
            if position[first] > position[owner]:
                raise TypeError(f"owner order: {owner} must fold after {first} ({why})")


check_owner_order(OWNER_ORDER, OWNER_AFTER)

# Inputs that change no state by themselves: the policy answers them with decisions.
STATELESS_INPUTS: tuple[type[ev.Event], ...] = (
    ev.RequestAborted,
    ev.SessionEnded,
    ev.DrainRequested,
    ev.WakeRequested,
)

Handler = Callable[[Any], RefChange | None]


def idle_owners(config: SchedulerConfig) -> frozenset[str]:
    """The owners that hold nothing under ``config``, so ``apply`` does not visit their folds:
    without external KV nothing is transferred (``transfers``), without soft loads no load is
    admitted without a row (``holdings``), an attention model has no state slot to
    checkpoint (``ckpts``), standard prefill turns never change (``turns``), and only the
    oracle's rules read the recorded future (``future``). Their queries still answer (empty,
    or the initial turn)."""
    idle = set()
    if not reads_future(config):
        idle.add("future")
    if config.turn_policy == "standard":
        idle.add("turns")
    if not config.hybrid:
        idle.add("ckpts")
    if not config.external.enabled:
        idle.add("transfers")
    if not config.soft_loads:
        idle.add("holdings")
    return frozenset(idle)


class EngineState:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = bs = config.block_size
        self.hybrid = config.hybrid
        max_blocks = -(-config.model.max_context // bs) + 1
        slots = config.num_checkpoint_slots if config.hybrid else 0
        capacity = config.checkpoint_capacity if config.hybrid else 0
        costs = (config.checkpoint_cost(False), config.checkpoint_cost(True))
        self.serving = Serving()
        self.pool = BlockPool(config.num_blocks, bs)
        self.sessions = SessionTable()
        self.holdings = LoadHoldings(max_blocks)
        self.seqs = SequenceTable(
            config.model, config.max_batch, max_blocks, bs, self.pool, config.identity,
            self.sessions.history, self.holdings, config.speculation.max_drafts,
            config.speculation.pipelined,
        )
        self.seqs.cache_when_planned = config.cache_when_planned
        self.sessions.bind(self.seqs)
        self.ckpts = CheckpointTable(config.max_batch, slots, bs, self.pool, capacity, costs)
        self.transfers = TransferTable(self.seqs)
        self.stats = Stats(block_size=bs)
        self.work = StepWork(self.seqs, self.ckpts, self.stats, config.hybrid)
        self.turns = Turns(config, self.seqs)
        self.future = FutureUses()
        self._routes = self._build_routes()
        # the routed handler that takes an arrival (``apply``'s second argument)
        self._arrival_fold: Callable[..., RefChange | None] = next(
            h for h in self._routes[ev.RequestArrived] if h == self.seqs.arrival_fold
        )

    def _build_routes(self) -> dict[type[ev.Event], tuple[Handler, ...]]:
        routes: dict[type[ev.Event], list[Handler]] = {}
        folded: set[type[ev.Event]] = set()
        idle = idle_owners(self.config)
        for name in OWNER_ORDER:
            for kind, handler in getattr(self, name).folds().items():
                folded.add(kind)
                if name not in idle:
                    routes.setdefault(kind, []).append(handler)
        every = set(ev.INPUT_TYPES) | set(ev.DECISION_TYPES)
        missing = every - folded - set(STATELESS_INPUTS)
        if missing:
            names = sorted(k.__name__ for k in missing)
            raise TypeError(f"events with no owner to fold them: {names}")
        return {kind: tuple(handlers) for kind, handlers in routes.items()}

    # ------------------------------------------------------------------------- fold

    def apply(self, event: ev.Event, arrival: Arrival | None = None) -> None:
        """Fold one event into every owner it concerns (ReplayMismatch if it cannot be).
        An arrival's fold takes its tokens and digests when the caller computed them
        (``SequenceTable.arrival``, for the policy's check): the prompt is hashed once."""
        handlers = self._routes.get(type(event))
        if handlers is None:
            if isinstance(event, STATELESS_INPUTS):
                return
            raise ReplayMismatch(f"no reducer for {type(event).__name__} (in this configuration)")
        pool, arrival_fold = self.pool, self._arrival_fold
        for handler in handlers:
            change = arrival_fold(event, arrival) if handler is arrival_fold else handler(event)
            if change is not None:
                pool.apply(change)

    # ------------------------------------------------------------------------ queries

    @property
    def step(self) -> int:
        return self.serving.step

    @property
    def clock(self) -> float:
        return self.serving.clock

    @property
    def sleeping(self) -> bool:
        return self.serving.sleeping

    def seq(self, seq_id: int) -> Seq:
        return self.seqs.seq(seq_id)

    def holders(self) -> list[np.ndarray]:
        """Every holder's block references (running rows, loads without a row, sessions,
        checkpoints, leases)."""
        t = self.seqs
        held = []
        for row in t.running_rows().tolist():
            seq = t.objs[row]
            assert seq is not None
            held.append(t.held_blocks(seq))
        held.extend(self.holdings.holders())
        held.extend(self.sessions.holders())
        held.extend(self.ckpts.holders())
        held.extend(self.transfers.lease_holders())
        return held

    @property
    def has_work(self) -> bool:
        """Something to schedule or to save (a finished sequence's state), or transfers to
        wait for. While admissions are held, only ready loads of the waiting are work; while
        running work is held too, no sequence is."""
        t = self.seqs
        held = self.serving.admissions_held
        admitting = bool(t.waiting) and (not held or bool(self.transfers.ready_loads()))
        serving = not (self.sleeping or self.serving.running_held) and (
            admitting or t.num_running > 0
        )
        saving = self.ckpts.reserving or bool(t.in_flight)  # (an outcome still to land)
        return serving or saving or self.transfers.busy or self.serving.drain_pending

    # -------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Cross-check every owner; raises InvariantError naming the first violation."""
        invariants.check_all(self)

    def snapshot(self) -> tuple[object, ...]:
        """Everything the owners hold, as plain comparable data (tests compare two)."""
        return (
            self.serving.snapshot(),
            self.pool.snapshot(),
            self.seqs.snapshot(),
            self.holdings.snapshot(),
            self.sessions.snapshot(),
            self.ckpts.snapshot(),
            self.transfers.snapshot(),
            self.turns.snapshot(),
            self.future.snapshot(),
            repr(self.work.extras),
            repr(self.stats),
        )
