"""Multimodal inputs under kvsched: which encoder inputs each step's chunks need, kept in
vLLM's own encoder cache bookkeeping (``EncoderCacheManager``), as vLLM's runner reads them
(``SchedulerOutput.scheduled_encoder_inputs`` and ``free_encoder_mm_hashes``).

Under vLLM a chunk, a prefix hit and a saved state may end inside an item
(``model.span_slices``): the runner computes an item's encoder output whole, keeps it in its
encoder cache and takes the embeddings each chunk covers, as with vLLM's own scheduler. The
encoder budget is kvsched's (``model.max_encoder_tokens`` = vLLM's encoder compute budget,
counted in span positions, every item a chunk reaches counted whole: at least the
embeddings vLLM counts): a step's chunks, with what running requests hold already (an item
a chunk stopped inside; under async scheduling, the items of the step in flight), never
embed more, so vLLM's encoder cache (at least the budget: ``encoder_budget``) has room.

Per step: each item a chunk reaches is scheduled for the encoder unless vLLM's encoder cache
holds its output (another request's, an earlier chunk's of the same request, or an earlier
one of the step); the step references every item it reads until its output is back, then
releases the items its rows have computed past (kept in the cache, freeable, until room is
needed: vLLM's rule); an item a row has not finished stays referenced for its next chunk.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.encoder_budget import MultiModalBudget
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from kvsched.plan import StepPlan

# (request, the indices of its items the step reads, where its row ends) per row of a step
Reads = list[tuple[Any, list[int], int]]


def encoder_budget(vllm_config: Any, mm_registry: Any) -> tuple[int, int]:
    """kvsched's encoder budget (the smaller of vLLM's encoder compute budget and encoder
    cache size: a step never needs more room than the cache has) and vLLM's encoder cache
    size, for this model (0, 0: it takes no multimodal inputs). ``mm_registry``: vLLM's
    registry (None: its global one, which vLLM's engine core leaves its scheduler to use)."""
    if not vllm_config.model_config.supports_multimodal_inputs:
        return 0, 0
    budget = MultiModalBudget(vllm_config, mm_registry or MULTIMODAL_REGISTRY)
    cache = int(budget.encoder_cache_size)
    return min(int(budget.encoder_compute_budget), cache), cache


class EncoderInputs:
    """The encoder inputs of kvsched's steps, in vLLM's encoder cache bookkeeping."""

    def __init__(self, cache_size: int) -> None:
        self.cache = EncoderCacheManager(cache_size)
        self._reads: deque[Reads] = deque()  # per launched step, oldest first

    def schedule(self, plan: StepPlan, req_of: dict[int, Any]) -> dict[str, list[int]]:
        """The items the chunks of ``plan`` reach that the encoder must compute (those
        vLLM's encoder cache does not hold), by request name; records what the step reads."""
        scheduled: dict[str, list[int]] = {}
        reads: Reads = []
        rows = zip(plan.seq_ids.tolist(), plan.starts.tolist(), plan.ends.tolist(), strict=True)
        for seq_id, start, end in rows:
            request = req_of[seq_id]
            items = [
                i for i, f in enumerate(request.mm_features or ())
                if f.mm_position.offset < end
                and start < f.mm_position.offset + f.mm_position.length
            ]
            if not items:
                continue
            reads.append((request, items, end))
            todo = [i for i in items if not self.cache.check_and_update_cache(request, i)]
            for i in todo:
                self._allocate(request, i)
            if todo:
                scheduled[request.request_id] = todo
        self._reads.append(reads)
        return scheduled

    def _allocate(self, request: Any, i: int) -> None:
        """Room for item ``i`` in vLLM's encoder cache (evicting unreferenced entries as vLLM
        does; the budget is kvsched's, so vLLM's own compute check is not applied), then the
        item: each is allocated at once, so none is counted twice."""
        if not self.cache.can_allocate(request, i, 1 << 62, 0):
            raise RuntimeError(
                f"request {request.request_id}: vLLM's encoder cache has no room for input {i}"
                f" ({request.get_num_encoder_embeds(i)} embeddings) beside the inputs in use"
            )
        self.cache.allocate(request, i)

    def empty_step(self) -> None:
        """An empty step was launched (it reads nothing)."""
        self._reads.append([])

    def landed(self) -> None:
        """The oldest launched step's output is back: the items its rows computed past are
        released (one a row stopped inside stays referenced for the row's next chunk)."""
        for request, items, end in self._reads.popleft() if self._reads else []:
            for i in items:
                position = request.mm_features[i].mm_position
                if position.offset + position.length <= end:
                    self.cache.free_encoder_input(request, i)

    def drop(self, request: Any) -> None:
        """A request finished or was preempted: every reference it holds is released."""
        self.cache.free(request)

    def freed(self) -> list[str]:
        """The cache entries evicted since the last call (the runner drops them)."""
        return list(self.cache.get_freed_mm_hashes())

    def reset(self) -> None:
        self.cache.reset()
