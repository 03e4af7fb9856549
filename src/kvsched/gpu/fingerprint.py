"""FingerprintExecutor: a cheap stand-in for a model whose output depends on its cache contents.

``SimulatedExecutor`` samples tokens from (seed, sequence id, position), so a scheduler that
loads the wrong KV block, reuses a block still being written, or forgets a state restore
still produces "correct" output. This executor keeps real (tiny) cache contents instead: the
KV slot of every computed token holds a 64-bit hash of the token's whole prefix, and each
state slot holds the hash of the prefix its sequence has consumed. A chunk continues the
hash from the KV of its previous position (or, for a hybrid model, from its state slot), and
a sampled token depends on the last hash and on a position-keyed digest of every KV slot of
the sequence's context (as attention reads all of them). So scheduler-level tests of prefix
caching, external KV loads and state-checkpoint restores can compare outputs with a cold
run: identical prefixes give identical tokens (independent of sequence ids and block ids),
and any wrong cache content changes them. Inconsistencies the executor can see directly (a
hybrid state that disagrees with the KV, a write into the null block) are recorded in
``mismatches`` rather than raised, so a test can assert that the list stays empty.

The cache ops run in the torch executor's order: ``state_save_before``, ``copy_blocks``,
``zero_blocks``, ``state_zero``, ``state_restore``, the forward, ``state_save``,
``copy_blocks_after``. A ``state_save_within`` triple (row i, tokens p, slot) stores the
hash after the chunk's first ``p - start`` tokens, ``h[p - 1]``, in the checkpoint slot.

Prefix hash: ``h[-1] = EMPTY_PREFIX``; ``h[p] = h[p-1] + g(token_p, p) mod 2**64`` with
``g(t, p) = splitmix64(t * 0x9E3779B97F4A7C15 ^ splitmix64(p + 0x1234567))``.

It also implements the connectors' ``BlockBuffer`` (a block is its ``block_size`` hashes,
little-endian uint64) and ``StateBuffer`` (conv: the slot's 8-byte hash, recurrent: empty),
so ``connectors.TransferEngine`` can save and load its blocks and state checkpoints.
"""

from __future__ import annotations

import numpy as np

from kvsched.connectors.errors import CorruptValueError
from kvsched.events.types import StepExecuted
from kvsched.gpu.sim import CostModel, _mix, check_sleep_level, other_token
from kvsched.plan import StepPlan

__all__ = ["EMPTY_PREFIX", "FingerprintExecutor", "prefix_hashes"]

EMPTY_PREFIX = 0x243F6A8885A308D3  # h[-1]: the hash (and the state) of an empty prefix
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_POS_SALT = np.uint64(0x1234567)
_DIGEST_SALT = np.uint64(0x5851F42D4C957F2D)


def prefix_hashes(
    tokens: np.ndarray, positions: np.ndarray, prev: int = EMPTY_PREFIX
) -> np.ndarray:
    """``h[p]`` for each (token, position), continuing from ``prev = h[positions[0] - 1]``."""
    with np.errstate(over="ignore"):
        pos = _mix(np.asarray(positions, dtype=np.int64).astype(np.uint64) + _POS_SALT)
        terms = _mix((np.asarray(tokens, dtype=np.int64).astype(np.uint64) * _GOLDEN) ^ pos)
        out: np.ndarray = np.cumsum(terms, dtype=np.uint64) + np.uint64(prev)
    return out


def _context_terms(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """What attention "reads" from the KV at each context position (position-keyed, so a
    permuted block table changes the digest)."""
    with np.errstate(over="ignore"):
        keyed = _mix(positions.astype(np.uint64) * _GOLDEN + _DIGEST_SALT)
        return _mix(values ^ keyed)


def _check_ids(ids: np.ndarray, limit: int, what: str) -> None:
    bad = ids[(ids < 0) | (ids >= limit)]
    if bad.size:
        raise ValueError(f"{what}: ids must be in [0, {limit}), got {bad[:8].tolist()}")


class FingerprintExecutor:
    """Executes ``StepPlan``s on hash-valued KV blocks and state slots (see the module doc)."""

    def __init__(
        self,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        num_state_slots: int = 0,
        cost: CostModel | None = None,
        drafts: int = 0,
        acceptance: float = 0.5,
    ) -> None:
        if vocab_size < 2 or num_blocks < 1 or block_size < 1 or num_state_slots < 0:
            raise ValueError("vocab_size >= 2, num_blocks >= 1, block_size >= 1 required")
        # Speculative decoding: ``drafts`` proposed after each sampled token, each the token
        # this model will sample there (it is deterministic) with probability ``acceptance``
        # (a hash of the prefix), else another one; drafts a plan schedules are verified.
        self.drafts, self.acceptance = drafts, acceptance
        self._h: list[np.ndarray] = []  # (with drafts: h of every position each row computed)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.cost = cost or CostModel()
        # kv[b, o]: h[p] of the token at slot b * block_size + o (0: never written)
        self.kv = np.zeros((num_blocks, block_size), dtype=np.uint64)
        # state[s]: h after the last token computed in slot s (0: never reset, not EMPTY_PREFIX)
        self.state = np.zeros(max(num_state_slots, 1), dtype=np.uint64)
        self.mismatches: list[str] = []
        self.sleep_level = 0
        self.newest: dict[int, int] = {}  # the last step's tokens (placeholders)
        self.rejected: dict[int, int] = {}  # and (drafts) each row's rejected drafts
        self.proposals: dict[int, list[int]] = {}  # and the drafts it proposed

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[0])

    # -------------------------------------------------------------------------- sleep

    def sleep(self, level: int) -> None:
        """Lose every KV block and state (at either level: it has no weights), as a real
        executor's released memory: a hit the scheduler still took after a drain would
        read zeros and change the tokens."""
        self.sleep_level = max(self.sleep_level, check_sleep_level(level))
        self.kv[:] = 0
        self.state[:] = 0

    def wake(self) -> None:
        self.sleep_level = 0

    # ------------------------------------------------------------------------ execute

    def execute(self, plan: StepPlan) -> StepExecuted:
        if self.sleep_level:
            raise RuntimeError(f"the executor sleeps (level {self.sleep_level}): wake it first")
        plan = plan.fill_placeholders(self.newest, self.rejected, self.proposals)  # (overlapped)
        self._check(plan)
        self._before(plan)
        last = self._forward(plan)
        self._after(plan)
        rows = np.nonzero(plan.sample)[0]
        seq_ids = np.asarray(plan.seq_ids[rows], dtype=np.int64).copy()
        if self.drafts or len(plan.num_drafts):
            return self._speculate(plan, rows, seq_ids)
        tokens = self._sample(plan, rows, last[rows])
        self.newest = dict(zip(seq_ids.tolist(), tokens.tolist(), strict=True))
        return StepExecuted(plan.step, seq_ids, tokens, self.cost.step_time(plan))

    def _speculate(self, plan: StepPlan, rows: np.ndarray, seq_ids: np.ndarray) -> StepExecuted:
        """Verify each sampled row's drafts (the token after each position it computed, while
        the draft there agrees) and propose the next ones."""
        out: list[int] = []
        counts: list[int] = []
        proposed: list[int] = []
        verified, bounds = plan.verified_drafts, plan.token_bounds
        self.newest, self.rejected, self.proposals = {}, {}, {}
        for i in rows.tolist():
            h, start, d = self._h[i], int(plan.starts[i]), int(verified[i])
            first = len(h) - 1 - d  # h index of the row's newest token
            guesses = plan.input_ids[bounds[i] + first + 1 : bounds[i + 1]].tolist()
            made: list[int] = []
            for j in range(d + 1):
                end = start + first + j + 1
                digest = self._digest_to(plan, i, end)
                made.append(self._token(h[first + j], digest))
                if j == d or guesses[j] != made[-1]:
                    break
            out += made
            counts.append(len(made))
            mine = self._propose(h[first + len(made) - 1], digest, made[-1], end)
            proposed += mine
            seq = int(plan.seq_ids[i])
            self.newest[seq], self.proposals[seq] = made[-1], mine
            self.rejected[seq] = d + 1 - len(made)
        return StepExecuted(
            plan.step, seq_ids, np.asarray(out, np.int32), self.cost.step_time(plan),
            counts=np.asarray(counts, np.int32),
            draft_counts=np.full(len(rows), self.drafts, np.int32),
            drafts=np.asarray(proposed, np.int32),
        )

    def _token(self, h: np.uint64, digest: np.uint64) -> int:
        """The token sampled after a position (``_sample``'s rule for one row)."""
        with np.errstate(over="ignore"):
            key = _mix(np.asarray([h ^ _mix(np.asarray([digest]))[0]], dtype=np.uint64))
            return int(key[0] % np.uint64(self.vocab_size - 1)) + 1

    def _digest_to(self, plan: StepPlan, i: int, end: int) -> np.uint64:
        """The row's context digest over positions [0, end)."""
        pos = np.arange(end, dtype=np.int64)
        blocks = plan.block_tables[i, pos // self.block_size]
        terms = _context_terms(self.kv[blocks, pos % self.block_size], pos)
        with np.errstate(over="ignore"):
            return np.uint64(terms.sum(dtype=np.uint64))

    def _propose(self, h: np.uint64, digest: np.uint64, token: int, pos: int) -> list[int]:
        """``drafts`` tokens after ``token`` (at ``pos``): the ones this model will sample
        there, if its KV is written as planned, each kept with probability ``acceptance``."""
        drafts = []
        for _ in range(self.drafts):
            h = prefix_hashes(np.asarray([token]), np.asarray([pos]), int(h))[0]
            with np.errstate(over="ignore"):
                digest = digest + _context_terms(np.asarray([h]), np.asarray([pos]))[0]
            token = self._token(h, digest)
            coin = int(_mix(np.asarray([h ^ _DIGEST_SALT], dtype=np.uint64))[0] % 1000)
            wrong = int(other_token(token, self.vocab_size))
            drafts.append(token if coin < 1000 * self.acceptance else wrong)
            pos += 1
        return drafts

    def _check(self, plan: StepPlan) -> None:
        """Plan bugs that would index outside the cache raise (as the torch executor's do),
        and so does a ``state_save_within`` p that is not a block boundary inside its chunk."""
        if plan.block_size != self.block_size:
            raise ValueError(f"plan block_size {plan.block_size} != {self.block_size}")
        nb, ns = self.num_blocks, len(self.state)
        within = np.asarray(plan.state_save_within, dtype=np.int64).reshape(-1, 3)
        for what, ids, limit in (
            ("copy_blocks", plan.copy_blocks, nb),
            ("zero_blocks", plan.zero_blocks, nb),
            ("copy_blocks_after", plan.copy_blocks_after, nb),
            ("block_tables", plan.block_tables, nb),
            ("slot_mapping", plan.slot_mapping, nb * self.block_size),
            ("state_slots", plan.state_slots, ns),
            ("state_zero", plan.state_zero, ns),
            ("state_restore", plan.state_restore, ns),
            ("state_save", plan.state_save, ns),
            ("state_save_before", plan.state_save_before, ns),
            ("state_save_within slot", within[:, 2], ns),
        ):
            _check_ids(np.asarray(ids), limit, what)
        for row, p, _ in within.tolist():
            if not 0 <= row < plan.num_seqs:
                raise ValueError(f"state_save_within: row {row} out of range [0, {plan.num_seqs})")
            start, end = int(plan.starts[row]), int(plan.ends[row])
            if not start < p < end or p % self.block_size:
                raise ValueError(
                    f"state_save_within: p {p} of row {row} must be a multiple of "
                    f"{self.block_size} strictly inside ({start}, {end})"
                )

    def _before(self, plan: StepPlan) -> None:
        before = self._pairs(plan, plan.state_save_before, "state_save_before")
        self.state[before[:, 1]] = self.state[before[:, 0]]  # first: zero/restore may overwrite
        copies = self._pairs(plan, plan.copy_blocks, "copy_blocks")
        self.kv[copies[:, 1]] = self.kv[copies[:, 0]]  # simultaneous: sources read first
        self.kv[self._ids(plan, plan.zero_blocks, "zero_blocks")] = 0
        self.state[self._ids(plan, plan.state_zero, "state_zero")] = np.uint64(EMPTY_PREFIX)
        restore = self._pairs(plan, plan.state_restore, "state_restore")
        self.state[restore[:, 1]] = self.state[restore[:, 0]]

    def _after(self, plan: StepPlan) -> None:
        save = self._pairs(plan, plan.state_save, "state_save")
        self.state[save[:, 1]] = self.state[save[:, 0]]
        copies = self._pairs(plan, plan.copy_blocks_after, "copy_blocks_after")
        self.kv[copies[:, 1]] = self.kv[copies[:, 0]]

    def _pairs(self, plan: StepPlan, pairs: np.ndarray, what: str) -> np.ndarray:
        """(src, dst) pairs, less those writing block / slot 0 (each one is a mismatch)."""
        arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        keep = arr[:, 1] != 0
        if not keep.all():
            self.mismatches.append(
                f"step {plan.step}: {what} writes the null block/slot: {arr.tolist()}"
            )
        kept: np.ndarray = arr[keep]
        return kept

    def _within(self, plan: StepPlan) -> np.ndarray:
        """``state_save_within`` (row, p, slot) triples, less those writing slot 0 or a
        runtime slot of this plan (each one is a mismatch)."""
        arr = np.asarray(plan.state_save_within, dtype=np.int64).reshape(-1, 3)
        runtime = np.asarray(plan.state_slots) if self.num_state_slots > 0 else np.zeros(0)
        bad = (arr[:, 2] == 0) | np.isin(arr[:, 2], runtime)
        if bad.any():
            self.mismatches.append(
                f"step {plan.step}: state_save_within writes the null slot or a runtime "
                f"slot: {arr[bad].tolist()}"
            )
        kept: np.ndarray = arr[~bad]
        return kept

    def _ids(self, plan: StepPlan, ids: np.ndarray, what: str) -> np.ndarray:
        """Destination ids, less the null block / slot 0 (a mismatch)."""
        arr = np.asarray(ids, dtype=np.int64)
        return self._pairs(plan, np.stack([arr, arr], axis=-1), what)[:, 0]

    # ------------------------------------------------------------------------ forward

    def _forward(self, plan: StepPlan) -> np.ndarray:
        """Compute every sequence's chunk (saving ``state_save_within`` states on the way);
        returns h[end - 1] per sequence."""
        bounds = plan.token_bounds
        last = np.zeros(plan.num_seqs, dtype=np.uint64)
        within = self._within(plan)
        self._h = []
        for i in range(plan.num_seqs):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            start, end = int(plan.starts[i]), int(plan.ends[i])
            positions = plan.positions[lo:hi]
            if not np.array_equal(positions, np.arange(start, end)):
                self._note(plan, i, f"positions {positions.tolist()} != [{start}, {end})")
            h = prefix_hashes(plan.input_ids[lo:hi], positions, self._prev(plan, i))
            self._write_kv(plan, i, plan.slot_mapping[lo:hi], h)
            for _, p, slot in within[within[:, 0] == i].tolist():
                if self._slot(plan, i):  # the state after the chunk's first p - start tokens
                    self.state[slot] = h[p - start - 1]
                else:
                    self._note(plan, i, f"state_save_within into slot {slot}: no state slot")
            if self._slot(plan, i):
                self.state[self._slot(plan, i)] = h[-1]
            last[i] = h[-1]
            if self.drafts or len(plan.num_drafts):
                self._h.append(h)
        return last

    def _slot(self, plan: StepPlan, i: int) -> int:
        """The sequence's runtime state slot, or 0 for an attention-only model."""
        return int(plan.state_slots[i]) if self.num_state_slots > 0 else 0

    def _prev(self, plan: StepPlan, i: int) -> int:
        """h[start - 1] as the model sees it: from the state slot (hybrid) else from the KV."""
        start = int(plan.starts[i])
        from_kv = self._kv_at(plan, i, start - 1) if start else EMPTY_PREFIX
        slot = self._slot(plan, i)
        if not slot:
            return from_kv
        from_state = int(self.state[slot])
        if from_state != from_kv:
            what = "the KV at position" if start else "the empty prefix before position"
            self._note(
                plan,
                i,
                f"state slot {slot} holds {from_state:#018x} but {what} {start - 1} "
                f"holds {from_kv:#018x}; using the state",
            )
        return from_state

    def _kv_at(self, plan: StepPlan, i: int, pos: int) -> int:
        bs = self.block_size
        block = int(plan.block_tables[i, pos // bs])
        if block == 0:
            self._note(plan, i, f"position {pos} is in the null block")
        value = int(self.kv[block, pos % bs])
        if value == 0:  # (a hash is never 0 in practice: 0 marks a slot never written)
            self._note(plan, i, f"position {pos} reads KV never written (block {block})")
        return value

    def _write_kv(self, plan: StepPlan, i: int, slots: np.ndarray, h: np.ndarray) -> None:
        blocks, offsets = np.divmod(np.asarray(slots, dtype=np.int64), self.block_size)
        null = blocks == 0
        if null.any():
            self._note(plan, i, f"writes {int(null.sum())} token(s) into the null block 0")
        self.kv[blocks[~null], offsets[~null]] = h[~null]

    def _note(self, plan: StepPlan, i: int, message: str) -> None:
        seq, start = int(plan.seq_ids[i]), int(plan.starts[i])
        self.mismatches.append(f"step {plan.step}, seq {seq} (start {start}): {message}")

    # ----------------------------------------------------------------------- sampling

    def _sample(self, plan: StepPlan, rows: np.ndarray, last: np.ndarray) -> np.ndarray:
        """One token per sampled row: a function of h[end - 1] and the context digest."""
        if not len(rows):
            return np.zeros(0, dtype=np.int32)
        with np.errstate(over="ignore"):
            key = _mix(last ^ _mix(self._context_digest(plan, rows)))
            return (key % np.uint64(self.vocab_size - 1) + np.uint64(1)).astype(np.int32)

    def _context_digest(self, plan: StepPlan, rows: np.ndarray) -> np.ndarray:
        """Per row: a wrapping sum over positions [0, end) of the KV read through the row's
        block table, keyed by position."""
        ends = np.asarray(plan.ends[rows], dtype=np.int64)
        offsets = np.cumsum(ends) - ends
        which = np.repeat(np.arange(len(rows)), ends)
        pos = np.arange(int(ends.sum()), dtype=np.int64) - np.repeat(offsets, ends)
        blocks = plan.block_tables[rows[which], pos // self.block_size]
        for j in np.unique(which[blocks == 0]).tolist():
            self._note(plan, int(rows[j]), "its context reads the null block 0")
        terms = _context_terms(self.kv[blocks, pos % self.block_size], pos)
        with np.errstate(over="ignore"):
            digest: np.ndarray = np.add.reduceat(terms, offsets, dtype=np.uint64)
        return digest

    # ------------------------------------------------------- BlockBuffer / StateBuffer

    @property
    def block_bytes(self) -> int:
        return self.block_size * 8

    def read_block(self, block_id: int) -> bytes:
        data: bytes = self.kv[block_id].astype("<u8").tobytes()
        return data

    def write_block(self, block_id: int, data: bytes) -> None:
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"cannot write block {block_id} (blocks 1..{self.num_blocks - 1})")
        if len(data) != self.block_bytes:
            raise CorruptValueError(
                f"block value is {len(data)} bytes, the executor's blocks are {self.block_bytes}"
            )
        self.kv[block_id] = np.frombuffer(data, dtype="<u8")

    def read_state(self, slot: int) -> tuple[bytes, bytes]:
        conv: bytes = self.state[slot : slot + 1].astype("<u8").tobytes()
        return conv, b""

    def write_state(self, slot: int, conv: bytes, recurrent: bytes) -> None:
        if not 0 < slot < len(self.state):
            raise ValueError(f"cannot write state slot {slot} (slots 1..{len(self.state) - 1})")
        if len(conv) != 8 or len(recurrent) != 0:
            raise CorruptValueError(
                f"state sizes {len(conv)}/{len(recurrent)} do not match the slots' 8/0 bytes"
            )
        self.state[slot] = np.frombuffer(conv, dtype="<u8")[0]
