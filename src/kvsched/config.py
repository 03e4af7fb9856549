"""Engine configuration: one frozen record, stored in every event log's header."""

from __future__ import annotations

from typing import Any, Literal

import attrs

MAX_BLOCKS = 1 << 26  # KV blocks of one engine
MAX_BATCH = 1 << 16  # batch rows
MAX_TABLE_ENTRIES = 1 << 28  # block-table entries (max_batch x blocks per sequence): 1 GiB

OrderPolicy = Literal["fcfs", "priority", "ttft"]


def _in_range(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
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

    def __attrs_post_init__(self) -> None:
        _in_range("vocab_size", self.vocab_size, 1, 1 << 31)
        _in_range("max_context", self.max_context, 2, 1 << 31)
        _in_range("routed_experts_per_token", self.routed_experts_per_token, 0, 1 << 12)


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
    decode_checkpoint_interval: int = 0  # tokens between decode checkpoints (0: none)
    # Save states only at block boundaries (no partial-block checkpoints at prompt ends), and
    # end a prompt's last chunk at the deepest boundary a later hit can use: for executors that
    # keep states in whole KV-cache blocks (vLLM's mamba "align" mode).
    aligned_checkpoints_only: bool = False
    num_speculative_tokens: int = 0  # MTP: the last k cached blocks of a hit are recomputed
    # External KV store: look up prefixes beyond the local cache and load them; save computed
    # blocks (and aligned state checkpoints) to it (roles both and prefill).
    external_kv: bool = False
    # Disaggregation: a prefill-role engine ends each request after its first token (reason
    # "migrated") once its prompt is saved; a decode-role engine loads prompts, saves nothing.
    role: Role = "both"

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
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"unknown role {self.role!r}")
        if self.role != "both" and not self.external_kv:
            raise ValueError(f"role {self.role!r} needs external_kv (the store carries the KV)")

    @property
    def external_load(self) -> bool:
        return self.external_kv

    @property
    def external_save(self) -> bool:
        return self.external_kv and self.role != "decode"

    @property
    def num_state_slots(self) -> int:
        """State pool rows: the null slot 0, one runtime slot per batch row, the checkpoints."""
        return 1 + self.max_batch + self.checkpoint_budget if self.hybrid else 1

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
