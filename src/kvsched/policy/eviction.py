"""Eviction strategies: which cached blocks and which checkpoints are given up for room.

The owners keep the candidates and the facts a strategy reads, and choose nothing:
``BlockPool.evictable_blocks`` (cached blocks nobody holds, least recently released first)
and ``CheckpointTable.evictable`` (unpinned published checkpoints, least recently used first;
their hits, costs, rules and the aging floor). A strategy orders the candidates; the policy
emits the evictions (``BlocksEvicted`` before the allocation that reuses the blocks,
``CheckpointEvicted`` with the victim's priority). Configuration names a strategy by its key:

* blocks (``BLOCK_EVICTION``): ``lru``, the only order the pool's prefix closure admits as
  is (a child is released, so offered, before its parent);
* checkpoints (``CHECKPOINT_EVICTION``, ``config.checkpoints.eviction``): ``lru``,
  ``frozen_first`` (lmdeploy: frozen partial tails first, then LRU), ``value``
  (greedy-dual-size-frequency, ``ValueEviction``) and ``oracle`` (Belady: the farthest next
  use first, from the recorded future ``FutureUses`` answers; ``OracleEviction``).

Every strategy is a pure function of the state it reads: a replay makes the same choices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Protocol

import numpy as np

from kvsched.config import EVICTIONS, SchedulerConfig
from kvsched.reducers.blocks import BlockPool
from kvsched.reducers.checkpoints import Checkpoint, CheckpointTable
from kvsched.reducers.ckpt_columns import ColumnsView
from kvsched.reducers.future import NEVER, FutureUses

Ranked = Iterable[tuple[float | None, Checkpoint]]


class BlockEviction(Protocol):
    def victims(self, pool: BlockPool, n: int) -> np.ndarray:
        """``n`` of ``pool.evictable_blocks()`` to evict, in event order: a block's cached
        children before it (the pool refuses an eviction that breaks prefix closure)."""
        ...


class CheckpointEviction(Protocol):
    def ranked(self, ckpts: CheckpointTable, future: FutureUses | None = None) -> Ranked:
        """Every evictable checkpoint, the first to evict first, each with its priority
        (None: the strategy has none, and never declines a new checkpoint). ``future``: the
        recorded future (read only by "oracle")."""
        ...

    def candidate_priority(
        self,
        ckpts: CheckpointTable,
        seq_id: int,
        step: int,
        kind: str,
        cost: int,
        future: FutureUses | None = None,
    ) -> float:
        """The priority a checkpoint about to be reserved would have (compared with its
        victims' priorities: a victim worth more declines it)."""
        ...


class LruBlocks:
    """The least recently released cached blocks first (the pool's own order)."""

    def victims(self, pool: BlockPool, n: int) -> np.ndarray:
        return np.fromiter(islice(pool.evictable_blocks(), n), dtype=np.int32, count=n)


# ------------------------------------------------------------------------- checkpoints


class LruCheckpoints:
    """The least recently used (published or last unpinned) first."""

    def __init__(self, config: SchedulerConfig) -> None:
        pass

    def ranked(self, ckpts: CheckpointTable, future: FutureUses | None = None) -> Ranked:
        return [(None, c) for c in ckpts.evictable()]

    def candidate_priority(
        self,
        ckpts: CheckpointTable,
        seq_id: int,
        step: int,
        kind: str,
        cost: int,
        future: FutureUses | None = None,
    ) -> float:
        return math.inf


class FrozenFirst(LruCheckpoints):
    """lmdeploy's order: checkpoints that own a frozen partial tail block first, then LRU."""

    def ranked(self, ckpts: CheckpointTable, future: FutureUses | None = None) -> Ranked:
        order = sorted(ckpts.evictable(), key=lambda c: (c.frozen_block == 0, c.stamp))
        return [(None, c) for c in order]


INTERIOR = frozenset(["chunk_end", "interval"])  # prefill points inside a prompt
ENDS = frozenset(["sequence_end", "session_end"])  # a finished sequence's end
# Points only an exact continuation reuses (a retry, a next turn): whether a workload has
# those is learned from how many of each rule's checkpoints were ever restored.
CONTINUATIONS = frozenset(
    ["prompt_end", "prompt_tail", "sequence_end", "session_end", "decode_latest"]
)
# The rules whose deeper checkpoint (same producer) makes a checkpoint redundant.
_DEEPER: dict[str, frozenset[str]] = {
    "chunk_end": INTERIOR,
    "interval": INTERIOR,
    "prompt_end": ENDS,
}
# (group, the rules it makes redundant), from _DEEPER
_RULES_BY_GROUP = tuple(
    (group, frozenset(k for k, g in _DEEPER.items() if g == group))
    for group in dict.fromkeys(_DEEPER.values())
)
# A branch checkpoint's frequency at birth: a request already shared its prefix, so it starts
# above an unshared checkpoint's 1. 4: the smallest value on the plateau of the synthetic trace
# and a branching chat (2 loses on both, 8 is level); docs/checkpoints.md, "How each constant
# is chosen".
BRANCH_BIRTH = 4


def _first(item: tuple[float, Checkpoint]) -> float:
    return item[0]


class ValueEviction:
    """Greedy-dual-size-frequency (Cao and Irani, 1997; Marconi's compute-per-byte score):

        priority = floor at its last touch + weight x (frequency ** 2) x saved seconds / cost

    the lowest evicted first (ties: least recently used). The frequency is 1 + its hits (+3
    for a branch checkpoint, born of a request that shared the prefix); the saved seconds
    are the prefill a hit of its step saves (``value_token_s``, ``value_pair_s``); the cost is
    what it uses of the capacity; a continuation rule's weight is the share of its
    checkpoints ever restored (Laplace-smoothed), others weigh 1. A checkpoint made redundant
    by a deeper one of its producer (interior prefill points, or the prompt end once the
    sequence's end is saved) is worth only its floor.

    ``ranked`` computes every evictable checkpoint's priority from the table's columns in
    float64 numpy operations, the very operations ``_priority`` applies to one checkpoint,
    in the same order (so the same floats), and sorts by (priority, stamp): stamps are
    unique, so the order is total and the same as sorting the records by that key, ties
    included. It is not a lazy heap: a priority is not fixed between its checkpoint's
    touches (a continuation rule's weight changes with each save of that rule and each
    first restore, reordering the rule's checkpoints whose floors differ; a checkpoint
    becomes redundant, so lower, when its producer reserves a deeper one), so a heap would
    have to be rebuilt at those events, most of them."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.token_s = config.checkpoints.value_token_s
        self.pair_s = config.checkpoints.value_pair_s

    def saved_seconds(self, tokens: int) -> float:
        """Prefill seconds a hit of ``tokens`` saves (linear work and attention pairs)."""
        return tokens * self.token_s + tokens * tokens / 2 * self.pair_s

    @staticmethod
    def redundant(ckpts: CheckpointTable, seq_id: int, kind: str, step: int) -> bool:
        """Whether a deeper checkpoint of producer ``seq_id`` makes a ``kind`` checkpoint at
        ``step`` redundant."""
        deeper = _DEEPER.get(kind)
        if deeper is None:
            return False
        return any(o.kind in deeper and o.step > step for o in ckpts.produced_by(seq_id))

    @staticmethod
    def weights(ckpts: CheckpointTable) -> dict[str, float]:
        """Continuation rules' weights: the share of their checkpoints ever restored
        (Laplace-smoothed); other rules weigh 1."""
        reused = ckpts.restores_by_rule()
        return {
            kind: (reused.get(kind, 0) + 1) / (made + 1)
            for kind, made in ckpts.saves_by_rule().items()
            if kind in CONTINUATIONS
        }

    def worth(self, kind: str, step: int, hits: int, cost: int) -> float:
        freq = hits + (BRANCH_BIRTH if kind == "branch" else 1)
        return freq * freq * self.saved_seconds(step) / cost

    def priority(self, ckpts: CheckpointTable, c: Checkpoint) -> float:
        """A checkpoint's priority (the lowest is evicted first)."""
        return self._priority(ckpts, c.seq_id, c.kind, c.step, c.hits, c.cost, c.floor)

    def candidate_priority(
        self,
        ckpts: CheckpointTable,
        seq_id: int,
        step: int,
        kind: str,
        cost: int,
        future: FutureUses | None = None,
    ) -> float:
        return self._priority(ckpts, seq_id, kind, step, 0, cost, ckpts.floor)

    def _priority(
        self,
        ckpts: CheckpointTable,
        seq_id: int,
        kind: str,
        step: int,
        hits: int,
        cost: int,
        floor: float,
    ) -> float:
        if self.redundant(ckpts, seq_id, kind, step):
            return floor
        return floor + self.weights(ckpts).get(kind, 1.0) * self.worth(kind, step, hits, cost)

    def scored(self, ckpts: CheckpointTable) -> list[tuple[float, int, Checkpoint]]:
        """(priority, stamp, checkpoint) of every evictable checkpoint, by slot."""
        prio, stamps, ids = self._columns(ckpts)
        return [
            (p, s, ckpts.get(i))
            for p, s, i in zip(prio.tolist(), stamps.tolist(), ids.tolist(), strict=True)
        ]

    def ranked(self, ckpts: CheckpointTable, future: FutureUses | None = None) -> Ranked:
        """Every evictable checkpoint by (priority, stamp), lazily: the order is fixed when
        this is called (later folds do not change it), each record is read as it is reached
        (the caller may evict the ones before it)."""
        prio, stamps, ids = self._columns(ckpts)
        order = np.lexsort((stamps, prio))  # (stamps are unique: a total order)
        return _lazy(ckpts, prio[order], ids[order])

    def _columns(self, ckpts: CheckpointTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(priority, stamp, ckpt id) of every evictable checkpoint, in one vectorised pass
        over the table's columns: ``_priority``'s arithmetic, operation for operation, in
        float64, so each priority is bit-identical to ``priority(ckpts, c)``."""
        cols = ckpts.value_columns()
        slots = np.flatnonzero(cols.evictable)
        kind, step, cost = cols.kind[slots], cols.step[slots], cols.cost[slots]
        floor = cols.floor[slots]
        weight_of = np.ones(len(cols.kinds) + 1)  # (+1: never empty)
        for name, weight in self.weights(ckpts).items():
            weight_of[cols.kinds.index(name)] = weight
        branch = cols.kinds.index("branch") if "branch" in cols.kinds else -1
        freq = cols.hits[slots] + np.where(kind == branch, BRANCH_BIRTH, 1)
        saved = step * self.token_s + step * step / 2 * self.pair_s  # (saved_seconds)
        worth = freq * freq * saved / cost  # (worth)
        prio = floor + weight_of[kind] * worth
        redundant = _redundant(cols, slots)
        prio[redundant] = floor[redundant]
        return prio, cols.stamp[slots], cols.ckpt_id[slots]


def _lazy(
    ckpts: CheckpointTable, prio: np.ndarray, ids: np.ndarray
) -> Iterator[tuple[float | None, Checkpoint]]:
    """(priority, checkpoint) pairs, each checkpoint read from the table when reached."""
    for i in range(len(ids)):
        yield float(prio[i]), ckpts.get(int(ids[i]))


def _redundant(cols: ColumnsView, slots: np.ndarray) -> np.ndarray:
    """Which of the checkpoints in ``slots`` a deeper live checkpoint of their producer in
    their ``_DEEPER`` group makes redundant (``ValueEviction.redundant``, vectorised)."""
    out = np.zeros(len(slots), dtype=bool)
    kind = cols.kind[slots]
    for group, rules in _RULES_BY_GROUP:
        which = np.flatnonzero(_is_one_of(cols.kinds, rules)[kind])
        if not len(which):
            continue
        deepest = _deepest_by_producer(cols, cols.live & _is_one_of(cols.kinds, group)[cols.kind])
        seq_ids, steps = cols.seq_id[slots[which]], cols.step[slots[which]]
        out[which] = _lookup(deepest, seq_ids) > steps
    return out


def _is_one_of(kinds: tuple[str, ...], names: frozenset[str]) -> np.ndarray:
    """By rule code: whether the rule is one of ``names`` (a lookup table for the codes)."""
    return np.array([k in names for k in kinds] + [False], dtype=bool)


def _deepest_by_producer(cols: ColumnsView, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(producers ascending, the deepest step of each) among the rows ``rows`` selects."""
    seq_ids, steps = cols.seq_id[rows], cols.step[rows]
    order = np.lexsort((steps, seq_ids))
    seq_ids, steps = seq_ids[order], steps[order]
    last = np.ones(len(seq_ids), dtype=bool)
    last[:-1] = seq_ids[1:] != seq_ids[:-1]
    return seq_ids[last], steps[last]


def _lookup(deepest: tuple[np.ndarray, np.ndarray], seq_ids: np.ndarray) -> np.ndarray:
    """Each producer's deepest step (-1: none)."""
    producers, steps = deepest
    if not len(producers):
        return np.full(len(seq_ids), -1, dtype=np.int64)
    pos = np.minimum(np.searchsorted(producers, seq_ids), len(producers) - 1)
    return np.where(producers[pos] == seq_ids, steps[pos], -1)


class OracleEviction:
    """Belady's choice (an upper reference): the checkpoint whose next use is farthest in the
    future first (never used again: first of all; ties: least recently used), its priority
    minus its next user's id, so a new checkpoint used later than every one it would replace
    is declined (Belady with bypass: the optimum for unit-cost items). The next uses come from
    the arrivals' recorded future (``FutureUses``), never from hidden state: a replay of the
    log ranks the same way."""

    def __init__(self, config: SchedulerConfig) -> None:
        pass

    @staticmethod
    def _future(future: FutureUses | None) -> FutureUses:
        if future is None:
            raise TypeError("eviction 'oracle' ranks by the recorded future: pass it")
        return future

    def ranked(self, ckpts: CheckpointTable, future: FutureUses | None = None) -> Ranked:
        uses = self._future(future)
        scored = [(-float(uses.next_use(c.ckpt_id)), c) for c in ckpts.evictable()]
        scored.sort(key=_first)  # (stable: least recently used first among equals)
        return scored

    def candidate_priority(
        self,
        ckpts: CheckpointTable,
        seq_id: int,
        step: int,
        kind: str,
        cost: int,
        future: FutureUses | None = None,
    ) -> float:
        user = self._future(future)
        nxt = user.pending_use(user.hinted(seq_id, step))
        # (a state no request will use is declined by every victim, even one never used)
        return -float(nxt + (1 if nxt == NEVER else 0))


BLOCK_EVICTION: dict[str, Callable[[], BlockEviction]] = {"lru": LruBlocks}
CHECKPOINT_EVICTION: dict[str, Callable[[SchedulerConfig], CheckpointEviction]] = {
    "lru": LruCheckpoints,
    "frozen_first": FrozenFirst,
    "value": ValueEviction,
    "oracle": OracleEviction,
}
if tuple(CHECKPOINT_EVICTION) != EVICTIONS:
    raise TypeError("config.EVICTIONS and CHECKPOINT_EVICTION name different strategies")

__all__ = [
    "BLOCK_EVICTION",
    "CHECKPOINT_EVICTION",
    "BlockEviction",
    "CheckpointEviction",
    "FrozenFirst",
    "LruBlocks",
    "LruCheckpoints",
    "OracleEviction",
    "ValueEviction",
]
