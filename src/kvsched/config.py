"""Engine configuration: one frozen record, stored in every event log's header."""

from __future__ import annotations

from typing import Any, Literal

import attrs

OrderPolicy = Literal["fcfs", "priority", "ttft"]
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
    max_step_retries: int = 2  # a sequence in more failed steps than this is aborted
    # Hybrid models (attention + gated DeltaNet / Mamba): one recurrent state per running
    # sequence, prefix hits usable only at published state checkpoints.
    hybrid: bool = False
    checkpoint_budget: int = 256  # checkpoint state slots (besides one runtime slot per row)
    decode_checkpoint_interval: int = 0  # tokens between decode checkpoints (0: none)
    num_speculative_tokens: int = 0  # MTP: the last k cached blocks of a hit are recomputed
    # External KV store: look up prefixes beyond the local cache and load them; save computed
    # blocks (and aligned state checkpoints) to it (roles both and prefill).
    external_kv: bool = False
    # Disaggregation: a prefill-role engine ends each request after its first token (reason
    # "migrated") once its prompt is saved; a decode-role engine loads prompts, saves nothing.
    role: Role = "both"

    def __attrs_post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_prefill_tokens < self.block_size:
            raise ValueError("max_prefill_tokens must be at least one block")
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
