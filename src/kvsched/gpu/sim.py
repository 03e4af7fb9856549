"""SimulatedExecutor: applies plans without tensors; a cost model gives each step a duration.

Sampled tokens are a deterministic function of (seed, sequence id, position), so runs are
reproducible and identical prompts produce identical outputs.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvsched.events.types import StepExecuted
from kvsched.plan import StepPlan


@attrs.frozen(kw_only=True)
class CostModel:
    """How long a step takes on the simulated GPU (seconds)::

        step = overhead_s
             + prefill tokens            x prefill_token_s   (weights: linear layers, MLP)
             + decoding sequences        x decode_seq_s      (per-sequence decode work)
             + KV tokens read            x kv_token_s        (every scheduled sequence reads
                                                              the KV of its context once)
             + prefill attention pairs   x prefill_attn_s    (query token x context token
                                                              pairs of prefill chunks)

    Defaults approximate a 7-8B model on one modern GPU: 10 us per prefill token (about 100k
    prefill tokens/s), 25 us per decoding sequence, reading the KV of 1M tokens in 3 ms, and
    1.3 ps per causal attention pair (4 x 32 layers x 4,096 hidden FLOPs at about 400 TFLOP/s),
    so a 128k-token prompt costs about 1.3 s of linear work plus 10.6 s of attention.

    Every parameter can be set from the command line: ``--cost prefill_attn_s=0,overhead_s=0.002``.
    """

    overhead_s: float = 0.004
    prefill_token_s: float = 1.0e-5
    decode_seq_s: float = 2.5e-5
    kv_token_s: float = 3.0e-9
    prefill_attn_s: float = 1.3e-12

    def step_time(self, plan: StepPlan) -> float:
        t = (
            self.overhead_s
            + plan.num_prefill_tokens * self.prefill_token_s
            + plan.num_decode_tokens * self.decode_seq_s
            + plan.kv_tokens_read * self.kv_token_s
        )
        if self.prefill_attn_s and plan.num_prefill_tokens:
            t += attention_pairs(plan) * self.prefill_attn_s
        return t

    @classmethod
    def parse(cls, spec: str) -> CostModel:
        """``name=value,name=value`` over the defaults; raises ValueError naming a bad item."""
        names = {f.name for f in attrs.fields(cls)}
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep or name not in names:
                known = ", ".join(sorted(names))
                raise ValueError(f"bad cost-model item {item!r} (known parameters: {known})")
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"cost-model parameter {name}: {raw!r} is not a number") from None
            if not value >= 0:
                raise ValueError(f"cost-model parameter {name} must be >= 0, got {raw}")
            values[name] = value
        return cls(**values)

    def to_dict(self) -> dict[str, float]:
        return attrs.asdict(self)


def attention_pairs(plan: StepPlan) -> float:
    """Causal (query, key) pairs of the step's prefill chunks: a chunk [s, e) attends
    e - s queries to s + 1 ... e keys. Decode rows (one token) are counted by kv_token_s."""
    starts = plan.starts.astype(np.float64)
    lens = plan.ends.astype(np.float64) - starts
    chunk = lens > 1
    return float((lens[chunk] * (starts[chunk] + (lens[chunk] + 1) / 2)).sum())


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised."""
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


_M64 = (1 << 64) - 1
_SMALL = 32  # below this many sampled tokens, Python integers beat numpy's per-call overhead


def _mix_int(x: int) -> int:
    """splitmix64 finaliser on one integer (identical to ``_mix``)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sample_tokens(seq_ids: np.ndarray, pos: np.ndarray, vocab_size: int, seed: int) -> np.ndarray:
    """The token sampled after position ``pos`` of each sequence: a pure function of
    (seed, sequence id, position), in [1, vocab_size)."""
    if len(seq_ids) < _SMALL:
        return np.asarray(
            [
                _mix_int(((s * 0x9E3779B97F4A7C15) & _M64) ^ _mix_int((p + seed) & _M64))
                % (vocab_size - 1)
                + 1
                for s, p in zip(seq_ids.tolist(), pos.tolist(), strict=True)
            ],
            dtype=np.int32,
        )
    with np.errstate(over="ignore"):
        key = (seq_ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ _mix(
            pos.astype(np.uint64) + np.uint64(seed)
        )
        return (_mix(key) % np.uint64(vocab_size - 1) + np.uint64(1)).astype(np.int32)


def other_token(tokens: np.ndarray | int, vocab_size: int) -> np.ndarray | int:
    """A token in [1, vocab_size) other than each of ``tokens`` (a wrong draft): the next id,
    wrapping to 1."""
    return tokens % (vocab_size - 1) + 1


def check_sleep_level(level: int) -> int:
    """``level`` if it is a sleep level (1: release the KV cache; 2: the weights too)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    return level


class SimulatedExecutor:
    """Samples each token as a pure function of (seed, sequence, position).

    Speculative decoding (``drafts`` > 0): after each sampled token it proposes ``drafts``
    draft tokens, each the true token with probability ``acceptance`` (a hash of the seed,
    sequence and position, so runs repeat), and verifies the drafts a plan schedules as a
    target model would: the drafts that equal the true tokens, up to the first that does not,
    are accepted, and one true token follows. The tokens produced are therefore the same with
    drafts as without; only the work per step changes."""

    def __init__(
        self,
        vocab_size: int,
        cost: CostModel | None = None,
        seed: int = 0,
        routed_experts_per_token: int = 0,
        num_experts: int = 64,
        drafts: int = 0,
        acceptance: float = 0.7,
    ) -> None:
        if drafts < 0 or not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"drafts must be >= 0 and acceptance in [0, 1], got "
                             f"{drafts} and {acceptance}")
        self.routed_experts_per_token = routed_experts_per_token
        self.num_experts = num_experts
        self.vocab_size = vocab_size
        self.cost = cost or CostModel()
        self.seed = seed
        self.drafts = drafts
        self.acceptance = acceptance
        self.sleep_level = 0  # it holds no memory: sleep only records the level
        # (overlapped steps with drafts) each row's rejected drafts and proposals, last step
        self.rejected: dict[int, int] = {}
        self.proposals: dict[int, list[int]] = {}

    def sleep(self, level: int) -> None:
        self.sleep_level = max(self.sleep_level, check_sleep_level(level))

    def wake(self) -> None:
        self.sleep_level = 0

    def execute(self, plan: StepPlan) -> StepExecuted:
        if self.sleep_level:
            raise RuntimeError(f"the executor sleeps (level {self.sleep_level}): wake it first")
        sample = plan.sample
        seq_ids = plan.seq_ids[sample]
        if self.drafts or len(plan.num_drafts):
            return self._speculate(plan)
        tokens = sample_tokens(seq_ids, plan.ends[sample], self.vocab_size, self.seed)
        experts = self._routed_experts(plan) if self.routed_experts_per_token else None
        if experts is None:
            return StepExecuted(plan.step, seq_ids, tokens, self.cost.step_time(plan))
        return StepExecuted(plan.step, seq_ids, tokens, self.cost.step_time(plan), experts)

    def _speculate(self, plan: StepPlan) -> StepExecuted:
        """Verify each sampling row's drafts, then propose the next ones (overlapped steps:
        a row planned while its last step ran verifies this executor's own proposals, after
        the tokens it accepted there: ``StepPlan.fill_placeholders``)."""
        plan = plan.fill_placeholders({}, self.rejected, self.proposals)
        self.rejected, self.proposals = {}, {}
        verified, bounds = plan.verified_drafts, plan.token_bounds
        vocab, seed = self.vocab_size, self.seed
        seq_ids, out, counts, proposed = [], [], [], []
        for i in np.nonzero(plan.sample)[0].tolist():
            seq, d = int(plan.seq_ids[i]), int(verified[i])
            first = int(plan.ends[i]) - d  # the index of the first token it samples
            ids = np.full(d + 1, seq, np.int64)
            true = sample_tokens(ids, first + np.arange(d + 1), vocab, seed)
            guesses = plan.input_ids[bounds[i] + 1 : bounds[i] + 1 + d]
            wrong = np.nonzero(guesses != true[:d])[0]
            accepted = int(wrong[0]) if len(wrong) else d
            seq_ids.append(seq)
            out.append(true[: accepted + 1])
            counts.append(accepted + 1)
            proposed.append(self._propose(seq, first + accepted + 1))
            self.rejected[seq], self.proposals[seq] = d - accepted, proposed[-1].tolist()
        tokens = np.concatenate(out) if out else np.zeros(0, np.int32)
        drafts = np.concatenate(proposed) if proposed else np.zeros(0, np.int32)
        experts = self._routed_experts(plan) if self.routed_experts_per_token else None
        return StepExecuted(
            plan.step, np.asarray(seq_ids, np.int64), tokens, self.cost.step_time(plan),
            routed_experts=np.zeros(0, np.int16) if experts is None else experts,
            counts=np.asarray(counts, np.int32),
            draft_counts=np.full(len(seq_ids), self.drafts, np.int32),
            drafts=drafts,
        )

    def _propose(self, seq: int, first: int) -> np.ndarray:
        """Drafts for token indices [first, first + drafts): each the true token when a
        hash of (seed, sequence, index) falls under ``acceptance``, else another one."""
        k, vocab = self.drafts, self.vocab_size
        ids, at = np.full(k, seq, np.int64), first + np.arange(k)
        true = sample_tokens(ids, at, vocab, self.seed)
        coin = sample_tokens(ids, at, 1 << 20, self.seed ^ 0x5EC) / float(1 << 20)
        return np.where(coin < self.acceptance, true, other_token(true, vocab)).astype(np.int32)

    def _routed_experts(self, plan: StepPlan) -> np.ndarray:
        """Deterministic expert ids per computed token: a function of (token, position), as a
        real router's are a function of the prefix."""
        k = self.routed_experts_per_token
        base = plan.input_ids.astype(np.uint64) * np.uint64(1_000_003) + plan.positions.astype(
            np.uint64
        )
        with np.errstate(over="ignore"):
            grid = base[:, None] * np.uint64(31) + np.arange(k, dtype=np.uint64)[None, :]
            ids = _mix(grid) % np.uint64(self.num_experts)
        return ids.astype(np.int16).reshape(-1)
