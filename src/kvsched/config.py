"""Engine configuration: one frozen record, stored in every event log's header."""

from __future__ import annotations

from typing import Any, Literal

import attrs

MAX_BLOCKS = 1 << 26  # KV blocks of one engine
MAX_BATCH = 1 << 16  # batch rows
MAX_TABLE_ENTRIES = 1 << 28  # block-table entries (max_batch x blocks per sequence): 1 GiB

OrderPolicy = Literal["fcfs", "priority", "ttft"]

# The TTFT order's prefill-turn policies (lmdeploy's _PrefillTurnPolicy, policy/turns.py): one
# kind of turn for every step, or lmdeploy's engine interleaving ("interleave": short-only turns
# while long prefills wait, a long-first turn after short_turns_per_long of them).
PREFILL_TURNS: tuple[str, ...] = (
    "standard", "short_only", "long_first", "long_first_if_final", "interleave"
)
# The order of long prefills on long-first turns: "size" (fewest chunks left, minus one per
# aging_s waited) or "fifo" (arrival); lmdeploy's LMDEPLOY_PT_TTFT_POLICY.
LONG_ORDERS: tuple[str, ...] = ("size", "fifo")

# Block identity schemes (identity.py, docs/identity.md): "kvs128" a native keyed 128-bit hash
# at memory speed (the default), "blake2b" cryptographic (every log before schema 4).
IDENTITY_SCHEMES: tuple[str, ...] = ("kvs128", "blake2b")

# Where a hybrid model saves state checkpoints (each a declared, named rule; policy/README.md):
PLACEMENTS: tuple[str, ...] = (
    "chunk_end",  # block-aligned ends of prefill chunks (lmdeploy)
    "prompt_end",  # the prompt end, its partial block frozen (lmdeploy)
    "prompt_tail",  # the last block boundary before the prompt's last token (vLLM "align")
    "interval",  # every checkpoint_interval tokens inside prefill chunks (vLLM "all" mode)
    "branch",  # where a request's cached KV runs past its deepest state (Marconi, SGLang)
    "sequence_end",  # the end of every finished sequence, prompt plus output (SGLang)
    "session_end",  # the end of a finished sequence of a session (its next turn resumes there)
    "decode",  # every decode_checkpoint_interval decode tokens, all kept (lmdeploy)
    "decode_blocks",  # every block boundary a decode step reaches, all kept (vLLM "align")
    "decode_latest",  # at block boundaries in decode, each replacing the sequence's previous
)
# Which checkpoint an eviction drops: least recently used; frozen partial tails first, then
# least recently used (lmdeploy); or the lowest value (prefill compute a hit saves per byte of
# state, times its hits squared, aged: greedy-dual-size-frequency), declining a new checkpoint
# worth less than every one it would replace.
EVICTIONS: tuple[str, ...] = ("lru", "frozen_first", "value")
# What an MTP hit recomputes (SchedulerConfig.mtp_overlap).
MTP_OVERLAPS: tuple[str, ...] = ("one_block", "k_blocks")
# How an external load is admitted (SchedulerConfig.load_admission).
LOAD_ADMISSIONS: tuple[str, ...] = ("soft", "whole_prompt")
# Named checkpoint policies: kvsched's own, and baselines that behave like its peers.
CHECKPOINT_POLICIES: dict[str, dict[str, Any]] = {
    "kvsched": {
        "checkpoint_placement": (
            "chunk_end", "prompt_end", "prompt_tail", "interval", "branch", "session_end"
        ),
        "checkpoint_eviction": "value",
        "aligned_checkpoints_only": False,
        "checkpoint_min_gain_blocks": 1,
    },
    "lmdeploy": {
        "checkpoint_placement": ("chunk_end", "prompt_end", "decode"),
        "checkpoint_eviction": "frozen_first",
        "aligned_checkpoints_only": False,
        "checkpoint_min_gain_blocks": 0,
    },
    "vllm-align": {
        "checkpoint_placement": ("chunk_end", "prompt_tail", "decode_blocks"),
        "checkpoint_eviction": "lru",
        "aligned_checkpoints_only": True,
        "checkpoint_min_gain_blocks": 0,
    },
    "sglang": {
        "checkpoint_placement": ("chunk_end", "sequence_end"),
        "checkpoint_eviction": "lru",
        "aligned_checkpoints_only": False,
        "checkpoint_min_gain_blocks": 0,
    },
}


def _in_range(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _rules(value: Any) -> tuple[str, ...]:
    return tuple(value)


TurnMode = Literal["mixed", "alternate"]
Role = Literal["both", "prefill", "decode"]


@attrs.frozen(kw_only=True)
class ModelSpec:
    """What the KV namespace depends on: two deployments with different specs never share KV."""

    name: str = "tiny-qwen3.5"
    vocab_size: int = 32000
    kv_dtype: str = "float16"
    kv_layout: str = "paged-nhd"
    max_context: int = 262144
    # MoE: routed-expert ids recorded per token (layers x top-k); 0 when none are recorded.
    routed_experts_per_token: int = 0
    # Memory, from the model's layer shapes (not part of the KV namespace). Defaults: the
    # shapes of Qwen3-Next-80B-A3B (36 gated-DeltaNet layers of 32 value heads x 128 x 128
    # float32 states plus bfloat16 conv states of 8,192 x 3; 12 attention layers of 2 KV
    # heads x 256 in bfloat16); ``gpu.HybridConfig.state_bytes`` computes them for a model.
    state_bytes: int = 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)  # one sequence's state
    kv_bytes_per_token: int = 12 * 2 * 2 * 256 * 2

    def __attrs_post_init__(self) -> None:
        _in_range("vocab_size", self.vocab_size, 1, 1 << 31)
        _in_range("max_context", self.max_context, 2, 1 << 31)
        _in_range("routed_experts_per_token", self.routed_experts_per_token, 0, 1 << 12)
        _in_range("state_bytes", self.state_bytes, 1, 1 << 40)
        _in_range("kv_bytes_per_token", self.kv_bytes_per_token, 1, 1 << 30)


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    model: ModelSpec = attrs.field(factory=ModelSpec)
    block_size: int = 64
    num_blocks: int = 4096
    max_batch: int = 256
    max_prefill_tokens: int = 8192
    max_long_chunks_per_step: int = 1
    order: OrderPolicy = "fcfs"
    aging_s: float = 10.0
    turn_mode: TurnMode = "mixed"
    prefill_interval: int = 16
    enable_prefix_caching: bool = True
    # An aborted turn of an open session stays part of its history (what it generated too;
    # its full blocks stay held for the next turn), as lmdeploy keeps a stopped turn. False:
    # the history stays as it was before the turn (kvsched before schema 4).
    keep_aborted_turns: bool = True
    # Idle sessions' held blocks are reclaimed least recently used first ("last_use"), or by
    # session id ("session_id": kvsched before schema 4).
    session_reclaim: str = "last_use"
    identity: str = "kvs128"  # the block identity scheme (IDENTITY_SCHEMES)
    # A computed block whose hash is already cached on another block is swapped for the cached
    # copy (its own block freed at once). Off where the executor cannot rewrite a block-table
    # entry it was already given (vLLM's workers only ever append): the copy then stays the
    # sequence's private block and is freed with it.
    dedup_cached_blocks: bool = True
    max_step_retries: int = 2  # a sequence in more failed steps than this is aborted
    # Hybrid models (attention + gated DeltaNet / Mamba): one recurrent state per running
    # sequence, prefix hits usable only at published state checkpoints.
    hybrid: bool = False
    checkpoint_budget: int = 256  # checkpoint state slots (besides one runtime slot per row)
    # Bytes for checkpoints (0: count them against checkpoint_budget instead): a checkpoint
    # costs the model's state_bytes, plus one KV block when it owns a frozen partial block;
    # the state pool then has checkpoint_memory // state_bytes checkpoint slots.
    checkpoint_memory: int = 0
    decode_checkpoint_interval: int = 0  # tokens between "decode" checkpoints (0: none)
    checkpoint_placement: tuple[str, ...] = attrs.field(
        default=CHECKPOINT_POLICIES["kvsched"]["checkpoint_placement"], converter=_rules
    )
    checkpoint_eviction: str = "value"
    checkpoint_interval: int = 4096  # tokens between "interval" checkpoints (whole blocks)
    # A save less than this many blocks past the state the sequence restored is not made: a
    # hit on it would save less prefill than its state slot (and frozen block) are worth.
    checkpoint_min_gain_blocks: int = 1
    # The executor can save a state in the middle of a chunk (plan.state_save_within); when it
    # cannot, "branch" and "prompt_tail" end a chunk there instead and "interval" is not used.
    mid_chunk_saves: bool = True
    # The value of a hit, in seconds of prefill it saves (eviction "value"): tokens x
    # value_token_s + causal attention pairs (tokens^2 / 2) x value_pair_s.
    value_token_s: float = 1.0e-5
    value_pair_s: float = 1.3e-9
    # Save states only at block boundaries (no partial-block checkpoints at prompt ends), and
    # end a prompt's last chunk at the deepest boundary a later hit can use: for executors that
    # keep states in whole KV-cache blocks (vLLM's mamba "align" mode).
    aligned_checkpoints_only: bool = False
    num_speculative_tokens: int = 0  # MTP: a hit's last cached block is recomputed (mtp_overlap)
    # External KV store: look up prefixes beyond the local cache and load them; save computed
    # blocks (and aligned state checkpoints) to it (roles both and prefill).
    external_kv: bool = False
    # Disaggregation: a prefill-role engine ends each request after its first token (reason
    # "migrated") once its prompt is saved; a decode-role engine loads prompts, saves nothing.
    role: Role = "both"
    # Alternate turn mode (lmdeploy's do_prefill_default): besides a half-empty batch and
    # prefill_interval decode turns, a prefill turn is also due when a running sequence's
    # next chunk is its last (prefill_on_last_chunk), or when the waiting sequences' tokens
    # fill a prefill budget, max_prefill_tokens (prefill_on_waiting_tokens). Both off:
    # kvsched before schema 4.
    prefill_on_last_chunk: bool = True
    prefill_on_waiting_tokens: bool = True
    # A decode that needs a new block takes blocks for this many more tokens too (lmdeploy:
    # 16), only from free blocks (never evicting cached ones); these spare blocks are given
    # back before anything else (a session hold, a checkpoint, a sequence) is given up for
    # room. 0: one block at a time.
    decode_prealloc_tokens: int = 0
    # Each finished or aborted sequence reports the prompt tokens its first admission did
    # not compute: local prefix hits, checkpoint restores, external loads (SequenceFinished,
    # SequenceAborted). Off: kvsched before schema 4 (the events carry no counts).
    report_cached_tokens: bool = True
    # MTP (num_speculative_tokens > 0): what a hit recomputes for the draft model. "one_block":
    # the last cached block, into a private block, while the sequence holds the cached one
    # (lmdeploy); "k_blocks": the last num_speculative_tokens cached blocks, swapped for the
    # cached copies once computed (kvsched before schema 4).
    mtp_overlap: str = "one_block"
    # Multimodal spans are never split: no chunk boundary, prefix hit, load or state save
    # falls strictly inside one (lmdeploy). False: kvsched before schema 4 (hits only).
    multimodal_safe: bool = True
    # Order "ttft" only: the prefill-turn policy (PREFILL_TURNS), the short turns before a
    # long chunk is due ("interleave"), the long lane's order (LONG_ORDERS), and how a waiting
    # request is sized: by the tokens left after its tentative prefix match ("after_match"), or
    # by its whole context, session history included ("context": kvsched before schema 4).
    prefill_turns: str = "interleave"
    short_turns_per_long: int = 3
    long_order: str = "size"
    ttft_size: str = "after_match"
    # How an external load is admitted. "soft" (lmdeploy's): it takes no batch row and holds
    # only the blocks it loads into (and, hybrid, a state slot); the rest of its prompt is
    # reserved softly (a new load is admitted only if its prefill fits beside every incomplete
    # load's reservation; ordinary work may borrow reserved blocks). "whole_prompt": it takes
    # a batch row and every block of its prompt at once (kvsched before schema 4).
    load_admission: str = "soft"

    def __attrs_post_init__(self) -> None:
        _in_range("block_size", self.block_size, 1, 1 << 16)
        _in_range("num_blocks", self.num_blocks, 2, MAX_BLOCKS)
        _in_range("max_batch", self.max_batch, 1, MAX_BATCH)
        _in_range("max_prefill_tokens", self.max_prefill_tokens, self.block_size, 1 << 24)
        _in_range("checkpoint_budget", self.checkpoint_budget, 0, 1 << 20)
        _in_range("max_long_chunks_per_step", self.max_long_chunks_per_step, 1, 1 << 20)
        _in_range("prefill_interval", self.prefill_interval, 1, 1 << 20)
        _in_range("max_step_retries", self.max_step_retries, 0, 1 << 20)
        _in_range("num_speculative_tokens", self.num_speculative_tokens, 0, 64)
        _in_range("decode_checkpoint_interval", self.decode_checkpoint_interval, 0, 1 << 31)
        _in_range("checkpoint_memory", self.checkpoint_memory, 0, 1 << 50)
        _in_range("checkpoint_interval", self.checkpoint_interval, 1, 1 << 31)
        _in_range("checkpoint_min_gain_blocks", self.checkpoint_min_gain_blocks, 0, 1 << 20)
        _in_range("decode_prealloc_tokens", self.decode_prealloc_tokens, 0, 1 << 20)
        for flag in ("prefill_on_last_chunk", "prefill_on_waiting_tokens", "report_cached_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        unknown = sorted(set(self.checkpoint_placement) - set(PLACEMENTS))
        if unknown or len(set(self.checkpoint_placement)) != len(self.checkpoint_placement):
            raise ValueError(
                f"checkpoint_placement: unknown or repeated rules {unknown or 'repeated'}; "
                f"known: {', '.join(PLACEMENTS)}"
            )
        if self.session_reclaim not in ("last_use", "session_id"):
            raise ValueError(
                f"unknown session_reclaim {self.session_reclaim!r}; known: last_use, session_id"
            )
        if self.identity not in IDENTITY_SCHEMES:
            raise ValueError(
                f"unknown identity scheme {self.identity!r}; known: {', '.join(IDENTITY_SCHEMES)}"
            )
        if self.checkpoint_eviction not in EVICTIONS:
            raise ValueError(
                f"unknown checkpoint_eviction {self.checkpoint_eviction!r}; "
                f"known: {', '.join(EVICTIONS)}"
            )
        for name in ("value_token_s", "value_pair_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.hybrid and self.checkpoint_memory and self.num_checkpoint_slots > 1 << 20:
            raise ValueError("checkpoint_memory holds more than 2**20 checkpoints")
        if not self.aging_s > 0:
            raise ValueError(f"aging_s must be positive, got {self.aging_s}")
        entries = self.max_batch * (self.model.max_context // self.block_size + 1)
        if entries > MAX_TABLE_ENTRIES:
            raise ValueError(
                f"block tables of max_batch {self.max_batch} x max_context "
                f"{self.model.max_context} / block_size {self.block_size} need {entries:,} "
                f"entries (at most {MAX_TABLE_ENTRIES:,}): lower one of them"
            )
        if self.order not in ("fcfs", "priority", "ttft"):
            raise ValueError(f"unknown order policy {self.order!r}")
        if self.decode_checkpoint_interval % self.block_size:
            raise ValueError("decode_checkpoint_interval must be a multiple of block_size")
        if self.turn_mode not in ("mixed", "alternate"):
            raise ValueError(f"unknown turn mode {self.turn_mode!r}")
        if self.mtp_overlap not in MTP_OVERLAPS:
            raise ValueError(
                f"unknown mtp_overlap {self.mtp_overlap!r}; known: {', '.join(MTP_OVERLAPS)}"
            )
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"unknown role {self.role!r}")
        if self.role != "both" and not self.external_kv:
            raise ValueError(f"role {self.role!r} needs external_kv (the store carries the KV)")
        _in_range("short_turns_per_long", self.short_turns_per_long, 1, 1 << 20)
        for name, value, known in (
            ("load_admission", self.load_admission, LOAD_ADMISSIONS),
            ("prefill_turns", self.prefill_turns, PREFILL_TURNS),
            ("long_order", self.long_order, LONG_ORDERS),
            ("ttft_size", self.ttft_size, ("after_match", "context")),
        ):
            if value not in known:
                raise ValueError(f"unknown {name} {value!r}; known: {', '.join(known)}")

    @property
    def turn_policy(self) -> str:
        """The prefill-turn policy in force: the TTFT order's; every other order takes
        standard turns (its own order, long prefills allowed)."""
        return self.prefill_turns if self.order == "ttft" else "standard"

    def long_prefill(self, tokens_left: int) -> bool:
        """Whether a prefill of this many tokens needs more than one chunk (lmdeploy: a
        non-final long prefill)."""
        return tokens_left > self.chunk_tokens

    @property
    def external_load(self) -> bool:
        return self.external_kv

    @property
    def soft_loads(self) -> bool:
        """External loads take no batch row, under soft reservations (load_admission)."""
        return self.external_kv and self.load_admission == "soft"

    @property
    def external_save(self) -> bool:
        return self.external_kv and self.role != "decode"

    @property
    def mtp_recompute_blocks(self) -> int:
        """Cached blocks at the end of a hit that MTP recomputes (0 without MTP)."""
        k = self.num_speculative_tokens
        return min(k, 1) if self.mtp_overlap == "one_block" else k

    @property
    def mtp_holds_overlap(self) -> bool:
        """Whether a sequence holds the cached block its MTP overlap recomputes privately."""
        return self.num_speculative_tokens > 0 and self.mtp_overlap == "one_block"

    @property
    def num_checkpoint_slots(self) -> int:
        """State pool rows for checkpoints: the count budget, or what the memory holds."""
        if self.checkpoint_memory:
            return self.checkpoint_memory // self.model.state_bytes
        return self.checkpoint_budget

    @property
    def checkpoint_capacity(self) -> int:
        """What checkpoints may use together: bytes, or a count (one per checkpoint)."""
        return self.checkpoint_memory or self.checkpoint_budget

    def checkpoint_cost(self, frozen: bool) -> int:
        """What one checkpoint uses of the capacity (a frozen partial block costs its KV)."""
        if not self.checkpoint_memory:
            return 1
        kv = self.model.kv_bytes_per_token * self.block_size
        return self.model.state_bytes + (kv if frozen else 0)

    @property
    def interval_tokens(self) -> int:
        """The "interval" rule's spacing: checkpoint_interval in whole blocks (at least one)."""
        return max(1, self.checkpoint_interval // self.block_size) * self.block_size

    def places(self, rule: str) -> bool:
        """Whether checkpoints are saved by placement rule ``rule`` (PLACEMENTS)."""
        return rule in self.checkpoint_placement

    @property
    def num_state_slots(self) -> int:
        """State pool rows: the null slot 0, one runtime slot per batch row, the checkpoints."""
        return 1 + self.max_batch + self.num_checkpoint_slots if self.hybrid else 1

    @property
    def chunk_tokens(self) -> int:
        """Canonical chunk length: the prefill budget rounded down to whole blocks."""
        return (self.max_prefill_tokens // self.block_size) * self.block_size

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SchedulerConfig:
        data = dict(data)
        model = ModelSpec(**data.pop("model", {}))
        return cls(model=model, **data)

    @classmethod
    def from_log_header(cls, data: dict[str, Any], schema_version: int) -> SchedulerConfig:
        """The config a log header records. Logs of schema 2 predate the checkpoint policies:
        they ran today's "lmdeploy" rules; logs before schema 4 hashed blocks with blake2b,
        dropped aborted turns from sessions, reclaimed sessions by id, had no alternate-mode
        triggers beyond a half-empty batch and prefill_interval, no decode preallocation,
        no cached-token counts on finished sequences, recomputed k blocks of an MTP hit,
        let chunks and loads split multimodal spans, ordered TTFT by whole contexts on
        long-first turns, and admitted a load with a batch row and every prompt block."""
        data = dict(data)
        if schema_version < 4:
            data.setdefault("identity", "blake2b")
            data.setdefault("checkpoint_min_gain_blocks", 0)
            data.setdefault("keep_aborted_turns", False)
            data.setdefault("session_reclaim", "session_id")
            data.setdefault("prefill_on_last_chunk", False)
            data.setdefault("prefill_on_waiting_tokens", False)
            data.setdefault("decode_prealloc_tokens", 0)
            data.setdefault("report_cached_tokens", False)
            data.setdefault("mtp_overlap", "k_blocks")
            data.setdefault("multimodal_safe", False)
            data.setdefault("ttft_size", "context")
            data.setdefault("prefill_turns", "long_first")
            data.setdefault("long_order", "size")
            data.setdefault("load_admission", "whole_prompt")
        if schema_version < 3:
            for key, value in CHECKPOINT_POLICIES["lmdeploy"].items():
                data.setdefault(key, value)
            data.setdefault("mid_chunk_saves", False)
        return cls.from_dict(data)

    def with_checkpoint_policy(self, name: str) -> SchedulerConfig:
        """This config under the named checkpoint policy (CHECKPOINT_POLICIES)."""
        if name not in CHECKPOINT_POLICIES:
            known = ", ".join(CHECKPOINT_POLICIES)
            raise ValueError(f"unknown checkpoint policy {name!r}; known: {known}")
        return attrs.evolve(self, **CHECKPOINT_POLICIES[name])
