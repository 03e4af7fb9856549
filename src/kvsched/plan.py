"""StepPlan: the frozen plain-data plan of one step, and its digest.

The executor sees only this: which tokens to compute for which sequences, where their KV
lives, which blocks to copy or zero, which state slots to reset, restore or save, and how to
sample. Arrays are read-only. This module imports nothing of the scheduler, so an executor
depends on the plan alone (``reducers.planner.plan_step`` builds it).

``plan_digest`` is the plan's fingerprint in every step record: one 8-byte digest per field,
in declaration order, so ``kvsched verify`` can say which field of a replayed plan differs
from the logged one. Its scheme follows the run's block identity (``SchedulerConfig.identity``):
``kvs128`` (an array field: one native pass over its bytes, keyed by a fixed root, continuing
a blake2b header of the field's name, dtype and shape) or ``blake2b`` (every field; every log
before schema 4).
"""

from __future__ import annotations

from functools import lru_cache
from hashlib import blake2b

import attrs
import numpy as np

from kvsched.identity import kvs128_digest

FIELD_DIGEST_SIZE = 8


def _empty(width: int) -> np.ndarray:
    arr = np.zeros((0, width), dtype=np.int32)
    arr.setflags(write=False)
    return arr


@attrs.frozen(kw_only=True)
class StepPlan:
    step: int
    clock: float
    block_size: int
    seq_ids: np.ndarray  # int64 [n]: decodes first, then prefill chunks
    starts: np.ndarray  # int64 [n]: first position computed
    ends: np.ndarray  # int64 [n]: one past the last position computed
    sample: np.ndarray  # bool [n]: sample a token after this sequence's last position
    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]: block * block_size + offset of each token's KV
    block_tables: np.ndarray  # int32 [n, max_blocks]; unused entries are the null block 0
    num_blocks: np.ndarray  # int32 [n]: blocks covering [0, end)
    copy_blocks: np.ndarray  # int32 [k, 2]: (src, dst) pairs to copy before the forward
    zero_blocks: np.ndarray  # int32 [k]
    # Hybrid models (all empty / zero for attention-only models). State slot 0 is the null slot.
    state_slots: np.ndarray  # int32 [n]: each sequence's runtime state slot
    state_zero: np.ndarray  # int32 [k]: runtime slots reset to zero before the forward
    state_restore: np.ndarray  # int32 [k, 2]: (checkpoint slot -> runtime slot) before forward
    state_save: np.ndarray  # int32 [k, 2]: (runtime slot -> checkpoint slot) after the forward
    copy_blocks_after: np.ndarray  # int32 [k, 2]: (src, dst) block copies after the forward
    temperature: np.ndarray  # float32 [n]
    seeds: np.ndarray  # int64 [n]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_hit_tokens: int  # prompt tokens served from the prefix cache by this step's admissions
    num_query_tokens: int  # prompt tokens of this step's first admissions
    # Hybrid state saves besides ``state_save`` (appended last, so older logs' plan digests
    # stay a prefix of today's). ``state_save_before``: (runtime slot -> checkpoint slot)
    # copied first of all, before ``copy_blocks``: the state a sequence that finished in the
    # previous step left in its runtime slot. ``state_save_within``: (plan row i, tokens p,
    # checkpoint slot): the state of row i after its first p tokens, starts[i] < p < ends[i],
    # p a multiple of block_size (an executor whose kernels write mid-chunk states, as the
    # chunked gated-delta scan does every 64 tokens).
    state_save_before: np.ndarray = attrs.field(factory=lambda: _empty(2))  # int32 [k, 2]
    state_save_within: np.ndarray = attrs.field(factory=lambda: _empty(3))  # int32 [k, 3]
    # Speculative decoding: the draft tokens each row verifies (int32 [n]; empty when no row
    # does): a decode row computes its newest token and these drafts (``input_ids``), and
    # samples after each of them.
    num_drafts: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int32))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor to do (no forward, no state to save)."""
        return len(self.seq_ids) == 0 and len(self.state_save_before) == 0

    @property
    def kv_tokens_read(self) -> int:
        return int(self.ends.sum())

    @property
    def token_bounds(self) -> np.ndarray:
        """Where each row's tokens start in ``input_ids``, then their total: row i's are
        ``input_ids[bounds[i]:bounds[i + 1]]``."""
        bounds: np.ndarray = np.concatenate(([0], np.cumsum(self.ends - self.starts)))
        return bounds

    @property
    def verified_drafts(self) -> np.ndarray:
        """The drafts each row verifies (zeros when no row does)."""
        if len(self.num_drafts):
            return self.num_drafts
        return np.zeros(self.num_seqs, np.int32)

    def fill_placeholders(
        self,
        newest: dict[int, int],
        rejected: dict[int, int] | None = None,
        proposals: dict[int, list[int]] | None = None,
    ) -> StepPlan:
        """This plan as the executor runs it (overlapped steps); itself when it has no
        placeholder. Each placeholder input id (-1: a token sampled in the step still running
        when this one was planned) is replaced by its sequence's token in ``newest`` (what
        the executor sampled in the step before, by sequence id; 0 for one it lacks: that
        step failed, and this one is voided). With speculative decoding, a row whose newest
        token is a placeholder verifies the executor's own ``proposals`` of that step (its
        placeholder drafts), and its work moves back by the drafts the executor rejected in
        that step (``rejected``): positions, slots and bounds, as vLLM's runner does."""
        at = np.nonzero(self.input_ids < 0)[0]
        if not len(at):
            return self
        bounds = self.token_bounds
        rows = np.searchsorted(bounds, at, side="right") - 1
        seqs = self.seq_ids[rows].tolist()
        ids = self.input_ids.copy()
        offsets = (at - bounds[rows]).tolist()  # 0: the newest token, j: the j-th draft
        proposed, shift = proposals or {}, []
        for k, (seq, j) in enumerate(zip(seqs, offsets, strict=True)):
            if j == 0:
                ids[at[k]] = newest.get(seq, 0)
                moved = (rejected or {}).get(seq, 0)
                if moved:
                    shift.append((int(rows[k]), moved))
            else:
                mine = proposed.get(seq, ())
                ids[at[k]] = mine[j - 1] if j <= len(mine) else 0
        ids.setflags(write=False)
        plan = attrs.evolve(self, input_ids=ids)
        return plan._moved_back(shift) if shift else plan

    def _moved_back(self, shift: list[tuple[int, int]]) -> StepPlan:
        """This plan with each (row, n) of ``shift`` computing its tokens n positions
        earlier (its slots read from its block table)."""
        bounds, bs = self.token_bounds, self.block_size
        positions, slots = self.positions.copy(), self.slot_mapping.copy()
        starts, ends = self.starts.copy(), self.ends.copy()
        for row, n in shift:
            lo, hi = int(bounds[row]), int(bounds[row + 1])
            positions[lo:hi] -= n
            starts[row] -= n
            ends[row] -= n
            pos = positions[lo:hi]
            slots[lo:hi] = self.block_tables[row, pos // bs].astype(np.int64) * bs + pos % bs
        for a in (positions, slots, starts, ends):
            a.setflags(write=False)
        return attrs.evolve(
            self, positions=positions, slot_mapping=slots, starts=starts, ends=ends
        )


PLAN_FIELDS: tuple[str, ...] = tuple(f.name for f in attrs.fields(StepPlan))


def _field_digest(name: str, value: object) -> bytes:
    h = blake2b(name.encode(), digest_size=FIELD_DIGEST_SIZE)
    if isinstance(value, np.ndarray):
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    else:
        h.update(repr(value).encode())
    return h.digest()


@lru_cache(maxsize=4096)
def _header(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    return blake2b(f"{name}{dtype}{shape}".encode(), digest_size=16).digest()


def _field_digest_kvs128(name: str, value: object) -> bytes:
    """A field's digest: an array's bytes by one native kvs128 call continuing a blake2b
    header of its name, dtype and shape (``identity.kvs128_digest``); a scalar by blake2b."""
    if not isinstance(value, np.ndarray):
        return _field_digest(name, value)
    header = _header(name, value.dtype.str, value.shape)
    return kvs128_digest(header, np.ascontiguousarray(value))[:FIELD_DIGEST_SIZE]


def plan_digest(plan: StepPlan, scheme: str = "kvs128") -> bytes:
    """``len(PLAN_FIELDS)`` concatenated 8-byte digests, one per field (``scheme``: the run's
    identity scheme; ``blake2b`` for logs before schema 4)."""
    digest = _field_digest_kvs128 if scheme == "kvs128" else _field_digest
    return b"".join(digest(name, getattr(plan, name)) for name in PLAN_FIELDS)


def first_plan_difference(logged: bytes, new: bytes, empty_tail: bool = False) -> str | None:
    """The name of the first field whose digest differs (None when equal). A shorter logged
    digest (an older layout: fields are only ever appended) is compared on the fields it
    has when ``empty_tail`` says the newer fields are empty; otherwise another length names
    the first field past the common part."""
    if logged == new:
        return None
    n = FIELD_DIGEST_SIZE
    for i, name in enumerate(PLAN_FIELDS):
        if logged[i * n : (i + 1) * n] != new[i * n : (i + 1) * n]:
            if i * n >= len(logged) and empty_tail and len(logged) % n == 0:
                return None  # an older layout, and the fields it lacks are empty
            return name
    return "<plan layout>"


def tail_is_empty(plan: StepPlan, logged_fields: int) -> bool:
    """Whether every field past the first ``logged_fields`` is an empty array."""
    return all(
        isinstance(v := getattr(plan, name), np.ndarray) and v.size == 0
        for name in PLAN_FIELDS[logged_fields:]
    )
