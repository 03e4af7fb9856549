"""TorchExecutor: applies a StepPlan to a real model on paged KV and state slots.

``execute(plan)`` runs, in this order:

1. ``state_save_before``: runtime slot -> checkpoint slot copies (the state a sequence that
   finished in the previous step left behind; first, as 4. or 5. may overwrite that slot);
2. ``copy_blocks``: KV block copies (src -> dst) in every attention layer;
3. ``zero_blocks``: KV blocks set to zero;
4. ``state_zero``: runtime state slots reset (conv and recurrent);
5. ``state_restore``: checkpoint slot -> runtime slot copies;
6. the forward over every sequence's ``[start, end)``. With ``state_save_within`` triples
   (row i, tokens p, checkpoint slot) it runs in passes: each row's range is cut at its save
   points, pass k computes every row's k-th segment (rows with fewer segments drop out), and
   after pass k the runtime state of each row whose segment ended at a save point is copied
   to the checkpoint slot. Without triples it is one forward;
7. ``state_save``: runtime slot -> checkpoint slot copies (the state after the forward);
8. ``copy_blocks_after``: KV block copies after the forward (a partial block snapshot);
9. sampling for the sequences with ``sample`` (logits of each row's last token, so of its
   last segment): greedy at temperature 0, else a draw from softmax(logits / temperature)
   with a CPU ``torch.Generator`` seeded from the sequence's seed and the sampled position
   (deterministic, the same on CPU and CUDA).

Copies within one list are simultaneous (all sources are read before any destination is
written: ``PagedCache`` copies with one indexed assignment). Every index of the plan is
validated before anything in the cache changes. The executor sees only the plan; it imports
nothing of the scheduler.

``sleep(level)`` (called by the driver after the scheduler's ``Drained``: nothing is held or
cached then) releases device memory: level 1 the KV blocks and state slots, level 2 the
weights too (``wake`` reloads them from the checkpoint directory the executor was built from,
else from a CPU copy taken at sleep). ``wake`` (after ``Woken``) makes a zeroed cache again.
A sleeping executor refuses plans.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from kvsched.events.types import StepExecuted
from kvsched.gpu.batch import BatchInputs
from kvsched.gpu.cache import PagedCache
from kvsched.gpu.model import HybridModel, read_checkpoint
from kvsched.gpu.sim import check_sleep_level
from kvsched.plan import StepPlan

_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (per-sequence seed, position): splitmix64 of both."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(position) + 0x632BE59BD9B4E019) & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchExecutor:
    """Runs StepPlans on a :class:`HybridModel` with a :class:`PagedCache`.

    ``model_dir_or_model`` is a checkpoint directory (``config.json`` + safetensors, Hugging
    Face names) or a loaded model (moved to ``device``). ``num_blocks``/``block_size`` size the
    paged KV, ``num_state_slots`` the state pool (slot 0 is the null slot). ``device``
    defaults to CUDA when available; ``dtype`` defaults to float32 (recurrent states are
    always float32).
    """

    def __init__(
        self,
        model_dir_or_model: str | os.PathLike[str] | HybridModel,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        device: str | torch.device | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.device = torch.device(device) if device is not None else _default_device()
        # where level-2 sleep reloads the weights from (None: a CPU copy taken at sleep)
        self._source: Path | None = None
        self._host_weights: dict[str, torch.Tensor] | None = None
        self.sleep_level = 0  # 0 awake; 1 no cache; 2 no cache and no weights
        self.newest: dict[int, int] = {}  # the last step's tokens (placeholders)
        if isinstance(model_dir_or_model, HybridModel):
            model = model_dir_or_model.to(device=self.device)
            if dtype is not None:
                model = model.to(dtype=dtype)
        else:
            self._source = Path(model_dir_or_model)
            model = HybridModel.from_pretrained(
                self._source, device=self.device, dtype=dtype or torch.float32
            )
        self.model = model.eval()
        self.config = model.config
        if num_blocks < 1 or block_size < 1 or num_state_slots < 1:
            raise ValueError("num_blocks, block_size and num_state_slots must be positive")
        self.num_blocks, self.block_size, self.num_state_slots = (
            num_blocks,
            block_size,
            num_state_slots,
        )
        self.cache: PagedCache = model.make_cache(num_blocks, block_size, num_state_slots)
        self.is_hybrid = bool(self.config.linear_layers)
        self.last_logits: torch.Tensor = torch.zeros((0, self.config.vocab_size))
        self.last_seq_ids: np.ndarray = np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------ helpers

    def _pairs(self, arr: np.ndarray, limit: int, what: str) -> torch.Tensor:
        a = np.asarray(arr, dtype=np.int64).reshape(-1, 2)
        if len(a) and (a.min() < 0 or a.max() >= limit):
            raise ValueError(f"{what} out of range [0, {limit}): {a.tolist()}")
        return torch.from_numpy(a.copy()).to(self.device)

    def _ids(self, arr: np.ndarray, limit: int, what: str) -> torch.Tensor:
        a = np.asarray(arr, dtype=np.int64).reshape(-1)
        if len(a) and (a.min() < 0 or a.max() >= limit):
            raise ValueError(f"{what} out of range [0, {limit}): {a.tolist()}")
        return torch.from_numpy(a.copy()).to(self.device)

    def _state_pairs(self, arr: np.ndarray, what: str) -> torch.Tensor:
        """(src, dst) state-slot pairs, both in [1, num_state_slots): 0 is the null slot."""
        a = np.asarray(arr, dtype=np.int64).reshape(-1, 2)
        ns = self.num_state_slots
        if len(a) and (a.min() < 1 or a.max() >= ns):
            raise ValueError(
                f"{what} slots must be in [1, {ns}) (0 is the null slot): {a.tolist()}"
            )
        return torch.from_numpy(a.copy()).to(self.device)

    def _within(self, plan: StepPlan) -> np.ndarray:
        """``state_save_within`` as int64 [k, 3] (row, p, checkpoint slot), validated."""
        a = np.asarray(plan.state_save_within, dtype=np.int64).reshape(-1, 3)
        ns, bs, n = self.num_state_slots, self.block_size, plan.num_seqs
        runtime = {int(x) for x in plan.state_slots}
        for row, p, slot in a.tolist():
            what = f"state_save_within ({row}, {p}, {slot})"
            if not 0 <= row < n:
                raise ValueError(f"{what}: row out of range [0, {n})")
            start, end = int(plan.starts[row]), int(plan.ends[row])
            if not start < p < end:
                raise ValueError(f"{what}: p must be strictly inside ({start}, {end})")
            if p % bs:
                raise ValueError(f"{what}: p is not a multiple of block_size {bs}")
            if not 1 <= slot < ns:
                raise ValueError(f"{what}: slot must be in [1, {ns}) (0 is the null slot)")
            if not 1 <= int(plan.state_slots[row]) < ns:
                raise ValueError(f"{what}: row {row} has no state slot")
            if slot in runtime:
                raise ValueError(f"{what}: slot {slot} is a runtime slot of this plan")
        return a

    def _check(self, plan: StepPlan) -> None:
        if plan.block_size != self.block_size:
            raise ValueError(f"plan block_size {plan.block_size} != executor {self.block_size}")
        lens = plan.ends - plan.starts
        if len(lens) and lens.min() < 1:
            raise ValueError("every sequence must compute at least one token")
        if int(lens.sum()) != len(plan.input_ids) or len(plan.positions) != len(plan.input_ids):
            raise ValueError("input_ids/positions do not match the sequences' token ranges")
        if len(plan.slot_mapping) and (
            plan.slot_mapping.min() < self.block_size
            or plan.slot_mapping.max() >= self.num_blocks * self.block_size
        ):
            raise ValueError("slot_mapping outside the KV pool (or in the null block)")
        tables = plan.block_tables
        if tables.size and (tables.min() < 0 or tables.max() >= self.num_blocks):
            raise ValueError(f"block_tables outside the KV pool [0, {self.num_blocks})")
        if len(plan.input_ids) and (
            plan.input_ids.min() < 0 or plan.input_ids.max() >= self.config.vocab_size
        ):
            raise ValueError("input_ids outside the vocabulary")
        if self.is_hybrid and len(plan.state_slots):
            slots = plan.state_slots
            if slots.min() < 1 or slots.max() >= self.num_state_slots:
                raise ValueError(
                    f"hybrid model: state_slots must be in [1, {self.num_state_slots}), "
                    f"got {slots.tolist()}"
                )
            if len(np.unique(slots)) != len(slots):
                raise ValueError(f"two sequences share a state slot: {slots.tolist()}")

    # ------------------------------------------------------------------ sleep

    def sleep(self, level: int) -> None:
        """Release device memory: level 1 the cache, level 2 the weights too (a deeper
        level than the current one deepens the sleep; a shallower one changes nothing)."""
        if check_sleep_level(level) <= self.sleep_level:
            return
        if self.sleep_level == 0:
            self.cache.release()
        if level == 2:
            if self._source is None:
                self._host_weights = {
                    k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
                }
            self.model.to(device="meta")
        self.sleep_level = level
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Restore what ``sleep`` released: the weights (level 2), then a zeroed cache."""
        if self.sleep_level == 2:
            self.model.to_empty(device=self.device)
            if self._source is not None:
                self.model.load_hf_state_dict(read_checkpoint(self._source))
            else:
                assert self._host_weights is not None
                self.model.load_state_dict(self._host_weights)
                self._host_weights = None
        if self.sleep_level:
            self.cache.allocate()
        self.sleep_level = 0

    # ------------------------------------------------------------------ execute

    def execute(self, plan: StepPlan) -> StepExecuted:
        t0 = time.perf_counter()
        if self.sleep_level:
            raise RuntimeError(f"the executor sleeps (level {self.sleep_level}): wake it first")
        plan = plan.fill_placeholders(self.newest)  # (overlapped steps)
        self._check(plan)
        cache, nb, ns = self.cache, self.num_blocks, self.num_state_slots
        # validate everything before touching the cache
        state_save_before = self._state_pairs(plan.state_save_before, "state_save_before")
        copy_blocks = self._pairs(plan.copy_blocks, nb, "copy_blocks")
        zero_blocks = self._ids(plan.zero_blocks, nb, "zero_blocks")
        state_zero = self._ids(plan.state_zero, ns, "state_zero")
        state_restore = self._pairs(plan.state_restore, ns, "state_restore")
        within = self._within(plan)
        state_save = self._pairs(plan.state_save, ns, "state_save")
        copy_blocks_after = self._pairs(plan.copy_blocks_after, nb, "copy_blocks_after")
        cache.copy_states(state_save_before)
        cache.copy_blocks(copy_blocks)
        cache.zero_blocks(zero_blocks)
        cache.zero_states(state_zero)
        cache.copy_states(state_restore)
        sample = np.asarray(plan.sample, dtype=bool)
        logits = torch.zeros((0, self.config.vocab_size))
        if plan.num_seqs and not len(within):
            logits = self._forward(plan, sample)
        elif plan.num_seqs:
            logits = self._forward_in_passes(plan, sample, within)
        cache.copy_states(state_save)
        cache.copy_blocks(copy_blocks_after)
        tokens = self._sample(
            logits, plan.temperature[sample], plan.seeds[sample], plan.ends[sample]
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_logits = logits
        seq_ids = np.asarray(plan.seq_ids[sample], dtype=np.int64).copy()
        self.last_seq_ids = seq_ids
        self.newest = dict(zip(seq_ids.tolist(), tokens.tolist(), strict=True))
        return StepExecuted(plan.step, seq_ids, tokens, time.perf_counter() - t0)

    def _forward(self, plan: StepPlan, sample: np.ndarray) -> torch.Tensor:
        """One forward over every row's ``[start, end)``; logits of the sampled rows."""
        batch = BatchInputs.build(
            input_ids=plan.input_ids,
            positions=plan.positions,
            slot_mapping=plan.slot_mapping,
            starts=plan.starts,
            ends=plan.ends,
            block_tables=plan.block_tables,
            state_slots=plan.state_slots,
            block_size=self.block_size,
            device=self.device,
        )
        last_rows = plan.token_bounds[1:] - 1
        index = torch.from_numpy(last_rows[sample].astype(np.int64)).to(self.device)
        logits: torch.Tensor = self.model(batch, self.cache, index)
        return logits

    def _forward_in_passes(
        self, plan: StepPlan, sample: np.ndarray, within: np.ndarray
    ) -> torch.Tensor:
        """The forward cut at the ``state_save_within`` points (see the module doc, step 6)."""
        starts = np.asarray(plan.starts, dtype=np.int64)
        ends = np.asarray(plan.ends, dtype=np.int64)
        offsets = np.cumsum(ends - starts) - (ends - starts)  # first flat token of each row
        cuts = [sorted({int(starts[i]), int(ends[i])}) for i in range(plan.num_seqs)]
        for row, p, _ in within.tolist():
            cuts[row] = sorted({*cuts[row], p})
        sampled_rank = np.cumsum(sample) - 1  # row -> its index among the sampled rows
        logits = torch.zeros(
            (int(sample.sum()), self.config.vocab_size), dtype=torch.float32, device=self.device
        )
        for k in range(max(len(c) for c in cuts) - 1):
            rows = np.array([i for i, c in enumerate(cuts) if len(c) - 1 > k], dtype=np.int64)
            seg_starts = np.array([cuts[i][k] for i in rows], dtype=np.int64)
            seg_ends = np.array([cuts[i][k + 1] for i in rows], dtype=np.int64)
            tok = np.concatenate(
                [
                    np.arange(a, b, dtype=np.int64) - starts[i] + offsets[i]
                    for i, a, b in zip(rows, seg_starts, seg_ends, strict=True)
                ]
            )
            batch = BatchInputs.build(
                input_ids=plan.input_ids[tok],
                positions=plan.positions[tok],
                slot_mapping=plan.slot_mapping[tok],
                starts=seg_starts,
                ends=seg_ends,
                block_tables=plan.block_tables[rows],
                state_slots=plan.state_slots[rows],
                block_size=self.block_size,
                device=self.device,
            )
            final = sample[rows] & (seg_ends == ends[rows])
            last_rows = np.cumsum(seg_ends - seg_starts) - 1
            index = torch.from_numpy(last_rows[final]).to(self.device)
            out = self.model(batch, self.cache, index)
            dest = torch.from_numpy(sampled_rank[rows[final]].astype(np.int64)).to(self.device)
            logits[dest] = out
            ended = {(int(i), int(b)) for i, b in zip(rows, seg_ends, strict=True)}
            saves = [
                (int(plan.state_slots[row]), slot)
                for row, p, slot in within.tolist()
                if (row, p) in ended
            ]
            pairs = torch.tensor(saves, dtype=torch.int64, device=self.device).reshape(-1, 2)
            self.cache.copy_states(pairs)
        return logits

    def _sample(
        self,
        logits: torch.Tensor,
        temperature: np.ndarray,
        seeds: np.ndarray,
        positions: np.ndarray,
    ) -> np.ndarray:
        n = logits.shape[0]
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        out = logits.argmax(dim=-1).cpu().numpy().astype(np.int32)
        hot = np.nonzero(np.asarray(temperature) > 0)[0]
        if len(hot):
            temps = torch.as_tensor(np.asarray(temperature)[hot], dtype=torch.float32)
            probs = torch.softmax(logits[torch.from_numpy(hot)].cpu() / temps[:, None], dim=-1)
            gen = torch.Generator()
            for j, i in enumerate(hot.tolist()):
                gen.manual_seed(sample_seed(int(seeds[i]), int(positions[i])))
                out[i] = int(torch.multinomial(probs[j], 1, generator=gen).item())
        return out
