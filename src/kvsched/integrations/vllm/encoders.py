"""Multimodal inputs under kvsched: which encoder inputs each step's chunks need, kept in
vLLM's own encoder cache bookkeeping (``EncoderCacheManager``), as vLLM's runner reads them
(``SchedulerOutput.scheduled_encoder_inputs`` and ``free_encoder_mm_hashes``).

kvsched never splits a multimodal span: a chunk, a prefix hit and a saved state end outside
every span (``policy/spans.py``), so a chunk that reaches an item embeds all of it, in the
chunk's step, and no later step of the request needs its encoder output. The encoder budget
is kvsched's (``model.max_encoder_tokens`` = vLLM's encoder compute budget, counted in span
positions, at least the embeddings vLLM counts): the chunks of a step never embed more,
but for the step's first prefill (vLLM likewise lets one item that fits the budget run).

Per step: each item starting in a chunk is scheduled for the encoder unless vLLM's encoder
cache holds its output (another request's, or an earlier one in the step); every item the
step reads is referenced until the step's output is back, then released (kept in the cache,
freeable, until room is needed: vLLM's rule).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.encoder_budget import MultiModalBudget
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from kvsched.plan import StepPlan

# (request, the indices of its items the step reads) per request of one step
Reads = list[tuple[Any, list[int]]]


def encoder_budget(vllm_config: Any, mm_registry: Any) -> tuple[int, int]:
    """vLLM's encoder compute budget and encoder cache size for this model (0, 0: it takes
    no multimodal inputs). ``mm_registry``: vLLM's registry (None: its global one, which
    vLLM's engine core leaves its scheduler to use)."""
    if not vllm_config.model_config.supports_multimodal_inputs:
        return 0, 0
    budget = MultiModalBudget(vllm_config, mm_registry or MULTIMODAL_REGISTRY)
    return int(budget.encoder_compute_budget), int(budget.encoder_cache_size)


class EncoderInputs:
    """The encoder inputs of kvsched's steps, in vLLM's encoder cache bookkeeping."""

    def __init__(self, cache_size: int) -> None:
        self.cache = EncoderCacheManager(cache_size)
        self._reads: deque[Reads] = deque()  # per launched step, oldest first

    def schedule(self, plan: StepPlan, req_of: dict[int, Any]) -> dict[str, list[int]]:
        """The items each chunk of ``plan`` embeds that the encoder must compute (those
        vLLM's encoder cache does not hold), by request name; records what the step reads."""
        scheduled: dict[str, list[int]] = {}
        reads: Reads = []
        rows = zip(plan.seq_ids.tolist(), plan.starts.tolist(), plan.ends.tolist(), strict=True)
        for seq_id, start, end in rows:
            request = req_of[seq_id]
            items = [
                i for i, f in enumerate(request.mm_features or ())
                if start <= f.mm_position.offset < end
            ]
            if not items:
                continue
            reads.append((request, items))
            todo = [i for i in items if not self.cache.check_and_update_cache(request, i)]
            for n, i in enumerate(todo):
                self._allocate(request, i, sum(request.get_num_encoder_embeds(j) for j in todo[:n]))
            if todo:
                scheduled[request.request_id] = todo
        self._reads.append(reads)
        return scheduled

    def _allocate(self, request: Any, i: int, before: int) -> None:
        if not self.cache.can_allocate(request, i, 1 << 62, before):
            raise RuntimeError(
                f"request {request.request_id}: vLLM's encoder cache has no room for input {i}"
                f" ({request.get_num_encoder_embeds(i)} embeddings) beside the inputs in use"
            )
        self.cache.allocate(request, i)

    def empty_step(self) -> None:
        """An empty step was launched (it reads nothing)."""
        self._reads.append([])

    def landed(self) -> None:
        """The oldest launched step's output is back: its reads are released."""
        for request, items in self._reads.popleft() if self._reads else []:
            for i in items:
                self.cache.free_encoder_input(request, i)

    def drop(self, request: Any) -> None:
        """A request finished or was preempted: every reference it holds is released."""
        self.cache.free(request)

    def freed(self) -> list[str]:
        """The cache entries evicted since the last call (the runner drops them)."""
        return list(self.cache.get_freed_mm_hashes())

    def reset(self) -> None:
        self.cache.reset()
