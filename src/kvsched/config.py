"""Engine configuration: one frozen record, stored in every event log's header.

``SchedulerConfig`` holds the settings every engine has; the settings of one concern sit in a
sub-config of their own (``Checkpoints``, ``PrefillTurns``; ``ExternalStore``, ``Speculation``
and ``Preemption`` in ``subconfigs.py``), and the behaviours of kvsched before schema 4 in
``Legacy``, which only an old log's header fills (``SchedulerConfig.from_log_header``). A
setting that another one makes ignored, or that contradicts another, is refused at
construction with a message naming both.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from kvsched import headers, presets, subconfigs
from kvsched.headers import FLAT_NAMES, header_settings, in_range, is_bool, one_of, refuse

# Defined beside the header reading (headers.py), found here with the rest of the config.
ConfigError = headers.ConfigError
Legacy = headers.Legacy
MTP_OVERLAPS = headers.MTP_OVERLAPS
LOAD_ADMISSIONS = headers.LOAD_ADMISSIONS

MAX_BLOCKS = 1 << 26  # KV blocks of one engine
MAX_BATCH = 1 << 16  # batch rows
MAX_TABLE_ENTRIES = 1 << 28  # block-table entries (max_batch x blocks per sequence): 1 GiB

# The defaults, one table for the library, the CLI and the vLLM adapter. What differs is
# deliberate: ``kvsched demo`` serves 64 chat sessions on DEMO_NUM_BLOCKS blocks and
# DEMO_MAX_BATCH rows, so that sessions contend for the cache (its recorded runs depend on
# them); ``kvsched replay`` defaults to an unbounded cache (replay.setup.unbounded_blocks),
# so only --cache-blocks makes it evict; the vLLM adapter takes vLLM's own KV cache size
# and max_num_seqs (vLLM decides memory) and sizes checkpoints from vLLM's pool.
BLOCK_SIZE = 64
NUM_BLOCKS = 4096
MAX_BATCH_ROWS = 256
MAX_PREFILL_TOKENS = 8192
CHECKPOINT_BUDGET = 256
DEMO_NUM_BLOCKS = 2048
DEMO_MAX_BATCH = 64

OrderPolicy = Literal["fcfs", "priority", "ttft"]
TurnMode = Literal["mixed", "alternate"]
Role = subconfigs.Role
# The sub-configs of what an engine does around its steps (subconfigs.py), found here too.
ExternalStore = subconfigs.ExternalStore
Speculation = subconfigs.Speculation
Preemption = subconfigs.Preemption

# The TTFT order's prefill-turn policies (lmdeploy's _PrefillTurnPolicy, policy/turns.py): one
# kind of turn for every step, or lmdeploy's engine interleaving ("interleave": short-only turns
# while long prefills wait, a long-first turn after short_per_long of them).
PREFILL_TURNS = ("standard", "short_only", "long_first", "long_first_if_final", "interleave")
# The order of long prefills on long-first turns: "size" (fewest chunks left, minus one per
# aging_s waited) or "fifo" (arrival); lmdeploy's LMDEPLOY_PT_TTFT_POLICY.
LONG_ORDERS: tuple[str, ...] = ("size", "fifo")

# Block identity schemes (identity.py, docs/identity.md): "kvs128" a native keyed 128-bit hash
# at memory speed (the default), "blake2b" cryptographic (every log before schema 4).
IDENTITY_SCHEMES: tuple[str, ...] = ("kvs128", "blake2b")

# The checkpoint rules and named rule sets (kvsched/presets.py), found here with the config.
CHECKPOINT_POLICIES = presets.CHECKPOINT_POLICIES
EVICTIONS = presets.EVICTIONS
PLACEMENTS = presets.PLACEMENTS
POLICY_ENGINE_SETTINGS = presets.POLICY_ENGINE_SETTINGS


def _is_set(record: Any, name: str) -> bool:
    """Whether a field of a config record differs from its default."""
    return bool(getattr(record, name) != _default(type(record), name))


def _default(cls: type, name: str) -> Any:
    """A plain default of a field (each one the refusals compare with)."""
    return getattr(attrs.fields(cls), name).default


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
    # LoRA: the adapters (``RequestArrived.adapter``) the executor applies in one step (vLLM's
    # max_loras; not part of the KV namespace): at most this many distinct ones among the
    # running sequences, a waiting sequence whose adapter would be one too many is skipped
    # for the step. 0: no limit.
    max_adapters: int = 0
    # Multimodal (not part of the KV namespace): the span positions the executor embeds in one
    # step (vLLM's encoder compute budget; 0: no limit): a chunk whose spans would take the
    # step past it waits (a chunk alone runs). ``span_slices``: the executor keeps a
    # span's encoder output across chunks (vLLM's runner), so a chunk, hit or state may end
    # inside a span (policy/spans.py); else never (lmdeploy's encoder embeds a span whole).
    max_encoder_tokens: int = 0
    span_slices: bool = False

    def __attrs_post_init__(self) -> None:
        in_range("vocab_size", self.vocab_size, 1, 1 << 31)
        in_range("max_context", self.max_context, 2, 1 << 31)
        in_range("routed_experts_per_token", self.routed_experts_per_token, 0, 1 << 12)
        in_range("state_bytes", self.state_bytes, 1, 1 << 40)
        in_range("kv_bytes_per_token", self.kv_bytes_per_token, 1, 1 << 30)
        in_range("max_adapters", self.max_adapters, 0, 1 << 16)
        in_range("max_encoder_tokens", self.max_encoder_tokens, 0, 1 << 31)
        is_bool("span_slices", self.span_slices)


@attrs.frozen(kw_only=True)
class Checkpoints:
    """Hybrid models' state checkpoints: how many, where saved, which evicted first."""

    budget: int = CHECKPOINT_BUDGET  # checkpoint state slots (besides one runtime slot per row)
    # Bytes for checkpoints (0: count them against budget instead): a checkpoint costs the
    # model's state_bytes, plus one KV block when it owns a frozen partial block; the state
    # pool then has memory // state_bytes checkpoint slots.
    memory: int = 0
    placement: tuple[str, ...] = attrs.field(
        default=CHECKPOINT_POLICIES["kvsched"]["placement"], converter=tuple
    )
    eviction: str = "value"
    interval: int = 4096  # tokens between "interval" saves (half a chunk: docs/checkpoints.md)
    decode_interval: int = 0  # tokens between "decode" checkpoints (0: none)
    # A save less than this many blocks past the state the sequence restored is not made: a
    # hit on it would save less prefill than its slot is worth (docs/checkpoints.md).
    min_gain_blocks: int = 1
    # The executor can save a state in the middle of a chunk (plan.state_save_within); when it
    # cannot, "branch" and "prompt_tail" end a chunk there instead and "interval" is not used.
    mid_chunk_saves: bool = True
    # Save states only at block boundaries (no partial-block checkpoints at prompt ends), and
    # end a prompt's last chunk at the deepest boundary a later hit can use: for executors that
    # keep states in whole KV-cache blocks (vLLM's mamba "align" mode).
    aligned_only: bool = False
    # The value of a hit, in seconds of prefill it saves (eviction "value"): tokens x
    # value_token_s + causal attention pairs (tokens^2 / 2) x value_pair_s.
    value_token_s: float = 1.0e-5
    value_pair_s: float = 1.3e-9

    def __attrs_post_init__(self) -> None:
        in_range("checkpoints.budget", self.budget, 0, 1 << 20)
        in_range("checkpoints.memory", self.memory, 0, 1 << 50)
        in_range("checkpoints.interval", self.interval, 1, 1 << 31)
        in_range("checkpoints.decode_interval", self.decode_interval, 0, 1 << 31)
        in_range("checkpoints.min_gain_blocks", self.min_gain_blocks, 0, 1 << 20)
        is_bool("checkpoints.mid_chunk_saves", self.mid_chunk_saves)
        is_bool("checkpoints.aligned_only", self.aligned_only)
        unknown = sorted(set(self.placement) - set(PLACEMENTS))
        if unknown or len(set(self.placement)) != len(self.placement):
            raise ConfigError(
                f"checkpoints.placement: unknown or repeated rules {unknown or 'repeated'}; "
                f"known: {', '.join(PLACEMENTS)}"
            )
        one_of("checkpoints.eviction", self.eviction, EVICTIONS)
        for name in ("value_token_s", "value_pair_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ConfigError(f"checkpoints.{name} must be a finite number >= 0, got {value!r}")

    def refuse_ignored(self) -> None:
        """Refuse a setting another one makes ignored (ConfigError naming both)."""
        if ("decode" in self.placement) != (self.decode_interval > 0):
            why = "places no checkpoint" if self.decode_interval else "needs"
            raise refuse("checkpoints.placement 'decode'", "checkpoints.decode_interval > 0", why)
        if "interval" in self.placement and not self.mid_chunk_saves:
            raise refuse("checkpoints.placement 'interval'", "checkpoints.mid_chunk_saves", "needs")
        headers.refuse_oracle_mix(self.placement, self.eviction, self.mid_chunk_saves)
        if self.interval != _default(Checkpoints, "interval") and "interval" not in self.placement:
            raise refuse(
                "checkpoints.interval", "checkpoints.placement 'interval'", "is used only by"
            )
        if self.eviction == "frozen_first" and self.aligned_only:
            raise refuse(
                "checkpoints.eviction 'frozen_first'",
                "checkpoints.aligned_only (no frozen partial blocks: plain 'lru')",
                "is the same as 'lru' under",
            )
        for name in ("value_token_s", "value_pair_s"):
            if getattr(self, name) != _default(Checkpoints, name) and self.eviction != "value":
                raise refuse(
                    f"checkpoints.{name}", "checkpoints.eviction 'value'", "is read only by"
                )


@attrs.frozen(kw_only=True)
class PrefillTurns:
    """When a step prefills, and (order "ttft") which prefills take its turn."""

    # "mixed": prefills and decodes in every step; "alternate" (lmdeploy's
    # do_prefill_default): prefill steps and decode steps, a prefill turn due when the batch
    # is half empty, after prefill_interval decode turns, and (Legacy) on a last chunk or a
    # full prefill budget of waiting tokens.
    mode: TurnMode = "mixed"
    prefill_interval: int = 16
    max_long_chunks_per_step: int = 1  # non-final chunks per step
    # Order "ttft" only: the prefill-turn policy (PREFILL_TURNS), the short turns before a
    # long chunk is due ("interleave"), the long lane's order (LONG_ORDERS).
    policy: str = "interleave"
    short_per_long: int = 3
    long_order: str = "size"

    def __attrs_post_init__(self) -> None:
        one_of("turns.mode", self.mode, ("mixed", "alternate"))
        in_range("turns.prefill_interval", self.prefill_interval, 1, 1 << 20)
        in_range("turns.max_long_chunks_per_step", self.max_long_chunks_per_step, 1, 1 << 20)
        one_of("turns.policy", self.policy, PREFILL_TURNS)
        in_range("turns.short_per_long", self.short_per_long, 1, 1 << 20)
        one_of("turns.long_order", self.long_order, LONG_ORDERS)

    def refuse_ignored(self, order: str, given: set[str] | None = None) -> None:
        """Refuse a setting another one makes ignored (ConfigError naming both): each field
        in ``given`` (the CLI: the options given), else each that is not its default."""
        if given is None:
            given = {f.name for f in attrs.fields(PrefillTurns) if _is_set(self, f.name)}
        if "prefill_interval" in given and self.mode != "alternate":
            raise refuse("turns.prefill_interval", "turns.mode 'alternate'", "is used only by")
        for name in ("policy", "short_per_long", "long_order"):
            if name in given and order != "ttft":
                raise refuse(f"turns.{name}", "order 'ttft'", "is used only by")
        if "short_per_long" in given and self.policy != "interleave":
            raise refuse("turns.short_per_long", "turns.policy 'interleave'", "is used only by")


# The sub-configs by field name (the flat names of their fields in log headers before
# sub-configs, schema 4 and older, are headers.FLAT_NAMES).
SUBCONFIGS: dict[str, type] = {
    "checkpoints": Checkpoints,
    "turns": PrefillTurns,
    "external": ExternalStore,
    "speculation": Speculation,
    "preemption": Preemption,
    "legacy": Legacy,
}


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    model: ModelSpec = attrs.field(factory=ModelSpec)
    block_size: int = BLOCK_SIZE
    num_blocks: int = NUM_BLOCKS
    max_batch: int = MAX_BATCH_ROWS
    max_prefill_tokens: int = MAX_PREFILL_TOKENS
    order: OrderPolicy = "fcfs"
    aging_s: float = 10.0  # orders "priority" and "ttft": one level (or chunk) per aging_s waited
    enable_prefix_caching: bool = True
    identity: str = "kvs128"  # the block identity scheme (IDENTITY_SCHEMES)
    # A computed block whose hash is already cached on another block is swapped for the cached
    # copy (its own block freed at once). Off where the executor cannot rewrite a block-table
    # entry it was already given (vLLM's workers only ever append): the copy then stays the
    # sequence's private block and is freed with it.
    dedup_cached_blocks: bool = True
    # Full blocks enter the prefix index in the step whose plan computes them (vLLM's
    # allocate_slots), not after its outcome: a later request of the step may hit them.
    cache_when_planned: bool = False
    max_step_retries: int = 2  # a sequence in more failed steps than this is aborted
    # A decode that needs a new block takes blocks for this many more tokens too (lmdeploy:
    # 16), only from free blocks (never evicting cached ones); these spare blocks are given
    # back before anything else (a session hold, a checkpoint, a sequence) is given up for
    # room. 0: one block at a time.
    decode_prealloc_tokens: int = 0
    # Hybrid models (attention + gated DeltaNet / Mamba): one recurrent state per running
    # sequence, prefix hits usable only at published state checkpoints.
    hybrid: bool = False
    checkpoints: Checkpoints = attrs.field(factory=Checkpoints)
    turns: PrefillTurns = attrs.field(factory=PrefillTurns)
    external: ExternalStore = attrs.field(factory=ExternalStore)
    speculation: Speculation = attrs.field(factory=Speculation)
    preemption: Preemption = attrs.field(factory=Preemption)
    legacy: Legacy = attrs.field(factory=Legacy)

    def __attrs_post_init__(self) -> None:
        in_range("block_size", self.block_size, 1, 1 << 16)
        in_range("num_blocks", self.num_blocks, 2, MAX_BLOCKS)
        in_range("max_batch", self.max_batch, 1, MAX_BATCH)
        in_range("max_prefill_tokens", self.max_prefill_tokens, self.block_size, 1 << 24)
        in_range("max_step_retries", self.max_step_retries, 0, 1 << 20)
        in_range("decode_prealloc_tokens", self.decode_prealloc_tokens, 0, 1 << 20)
        is_bool("cache_when_planned", self.cache_when_planned)
        one_of("identity scheme", self.identity, IDENTITY_SCHEMES)
        one_of("order policy", self.order, ("fcfs", "priority", "ttft"))
        if not self.aging_s > 0:
            raise ConfigError(f"aging_s must be positive, got {self.aging_s}")
        if self.checkpoints.decode_interval % self.block_size:
            raise refuse("checkpoints.decode_interval", "block_size", "must be a multiple of")
        if self.hybrid and self.checkpoints.memory and self.num_checkpoint_slots > 1 << 20:
            raise ConfigError("checkpoints.memory holds more than 2**20 checkpoints")
        entries = self.max_batch * (self.model.max_context // self.block_size + 1)
        if entries > MAX_TABLE_ENTRIES:
            raise ConfigError(
                f"block tables of max_batch {self.max_batch} x max_context "
                f"{self.model.max_context} / block_size {self.block_size} need {entries:,} "
                f"entries (at most {MAX_TABLE_ENTRIES:,}): lower one of them"
            )
        if not self.legacy.header:
            self._refuse_ignored()

    def _refuse_ignored(self) -> None:
        """Refuse settings another one makes ignored or contradicts (a config from an old
        log's header is exempt: it replays what that run did)."""
        self.checkpoints.refuse_ignored()
        if not self.hybrid:
            for field in attrs.fields(Checkpoints):
                if _is_set(self.checkpoints, field.name):
                    raise refuse(f"checkpoints.{field.name}", "hybrid", "is used only with")
        self.turns.refuse_ignored(self.order)
        # each of these reads KV a plan has not written (kvsched's saves start at the fold of
        # the outcome that wrote their blocks: ExternalKVMachineUnderVllmStore)
        if self.cache_when_planned:
            for name, on in (
                ("dedup_cached_blocks", self.dedup_cached_blocks),
                ("speculation.tokens", self.speculation.tokens),
            ):
                if on:
                    raise refuse("cache_when_planned", name, "is not supported with")
        if self.speculation.pipelined:  # (not in the first cut of overlapped steps)
            for name, on in (
                ("speculation.tokens", self.speculation.tokens),
                ("model.routed_experts_per_token", self.model.routed_experts_per_token),
            ):
                if on:
                    raise refuse("speculation.pipelined", name, "is not supported with")
        if self.speculation.lookahead and self.external.enabled:  # (loads take no lookahead)
            raise refuse("speculation.lookahead", "external.enabled", "is not supported with")
        if self.checkpoints.memory and self.checkpoints.budget != CHECKPOINT_BUDGET:
            raise refuse(
                "checkpoints.budget", "checkpoints.memory (which sets the count)", "is ignored with"
            )
        if not self.preemption.admit_after and self.turn_policy != "standard":
            raise refuse("admit_after_preemption false", "order 'ttft'", "is not supported with")

    @property
    def turn_policy(self) -> str:
        """The prefill-turn policy in force: the TTFT order's; every other order takes
        standard turns (its own order, long prefills allowed)."""
        return self.turns.policy if self.order == "ttft" else "standard"

    def long_prefill(self, tokens_left: int) -> bool:
        """Whether a prefill of this many tokens needs more than one chunk (lmdeploy: a
        non-final long prefill)."""
        return tokens_left > self.chunk_tokens

    @property
    def external_load(self) -> bool:
        return self.external.enabled

    @property
    def soft_loads(self) -> bool:
        """External loads take no batch row, under soft reservations (Legacy.load_admission)."""
        return self.external.enabled and self.legacy.load_admission == "soft"

    @property
    def external_save(self) -> bool:
        ext = self.external
        return ext.enabled and ext.role != "decode" and ext.saver == "kvsched"

    @property
    def mtp_recompute_blocks(self) -> int:
        """Cached blocks at the end of a hit that MTP recomputes (0 without MTP)."""
        if self.speculation.eagle_block_drop:
            return 1  # (vLLM's rule: a hit gives up its last block)
        k = self.speculation.tokens
        return min(k, 1) if self.legacy.mtp_overlap == "one_block" else k

    @property
    def mtp_holds_overlap(self) -> bool:  # its MTP overlap's cached block held privately
        return self.speculation.tokens > 0 and self.legacy.mtp_overlap == "one_block"

    @property
    def num_checkpoint_slots(self) -> int:
        """State pool rows for checkpoints: the count budget, or what the memory holds."""
        if self.checkpoints.memory:
            return self.checkpoints.memory // self.model.state_bytes
        return self.checkpoints.budget

    @property
    def checkpoint_capacity(self) -> int:  # bytes, or a count (one per checkpoint)
        return self.checkpoints.memory or self.checkpoints.budget

    def checkpoint_cost(self, frozen: bool) -> int:
        """What one checkpoint uses of the capacity (a frozen partial block costs its KV)."""
        if not self.checkpoints.memory:
            return 1
        kv = self.model.kv_bytes_per_token * self.block_size
        return self.model.state_bytes + (kv if frozen else 0)

    @property
    def interval_tokens(self) -> int:
        """The "interval" rule's spacing: checkpoints.interval in whole blocks (at least one)."""
        return max(1, self.checkpoints.interval // self.block_size) * self.block_size

    def places(self, rule: str) -> bool:
        """Whether checkpoints are saved by placement rule ``rule`` (PLACEMENTS)."""
        return rule in self.checkpoints.placement

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
        """The config ``to_dict`` wrote; the flat names of headers before sub-configs
        (FLAT_NAMES) are read too. Legacy behaviours only from a header (``Legacy``)."""
        data = dict(data)
        subs: dict[str, dict[str, Any]] = {k: dict(data.pop(k, None) or {}) for k in SUBCONFIGS}
        for flat in [k for k in data if k in FLAT_NAMES]:
            sub, name = FLAT_NAMES[flat]
            subs[sub][name] = data.pop(flat)
        model = data.pop("model", {})
        return cls(
            model=model if isinstance(model, ModelSpec) else ModelSpec(**model),
            **{k: SUBCONFIGS[k](**v) for k, v in subs.items()},
            **data,
        )

    @classmethod
    def from_log_header(cls, data: dict[str, Any], schema_version: int) -> SchedulerConfig:
        """The config a log header records (``headers.header_settings``: what an old log's
        kvsched ran), its legacy record marked ``header``: exempt from today's refusals of
        ignored combinations, so every old log replays."""
        return cls.from_dict(header_settings(data, schema_version))

    def with_checkpoint_policy(self, name: str) -> SchedulerConfig:
        """This config under the named checkpoint policy (CHECKPOINT_POLICIES) with its
        engine settings (POLICY_ENGINE_SETTINGS)."""
        return attrs.evolve(self, **self._engine_settings(name, checkpoints=True))

    def with_engine_settings(self, name: str) -> SchedulerConfig:
        """This config with the named policy's engine settings only (POLICY_ENGINE_SETTINGS:
        an attention-only model's, which has no checkpoints)."""
        return attrs.evolve(self, **self._engine_settings(name, checkpoints=False))

    def _engine_settings(self, name: str, checkpoints: bool) -> dict[str, Any]:
        """``attrs.evolve`` arguments for the named policy's engine settings (a sub-config's
        field by its flat name, FLAT_NAMES) and, if asked, its checkpoint rules; an unknown
        policy is refused."""
        if name not in CHECKPOINT_POLICIES:
            known = ", ".join(CHECKPOINT_POLICIES)
            raise ConfigError(f"unknown checkpoint policy {name!r}; known: {known}")
        settings = dict(POLICY_ENGINE_SETTINGS.get(name, {}))
        subs: dict[str, dict[str, Any]] = {}
        if checkpoints:
            subs["checkpoints"] = dict(CHECKPOINT_POLICIES[name])
        for flat in [k for k in settings if k in FLAT_NAMES]:
            sub, field = FLAT_NAMES[flat]
            subs.setdefault(sub, {})[field] = settings.pop(flat)
        evolved = {sub: attrs.evolve(getattr(self, sub), **v) for sub, v in subs.items()}
        return {**settings, **evolved}
