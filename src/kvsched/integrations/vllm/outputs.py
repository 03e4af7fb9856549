"""What the adapter hands vLLM back: a plan vLLM can run (checked), one ``EngineCoreOutput``
per sampled token or refused request, the scheduler's stats, KV cache events."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisherFactory,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
from vllm.v1.request import Request, RequestStatus

from kvsched.integrations.vllm import config as cfg
from kvsched.integrations.vllm.kv_events import EventGroups, KVEventTranslator


class AdapterMismatch(RuntimeError):
    """kvsched and vLLM disagree about a request (a bug in the adapter or the engine)."""


def check_plan(plan: Any) -> None:
    """Refuse a plan with work vLLM's model runner cannot do."""
    if len(plan.copy_blocks) or len(plan.copy_blocks_after) or len(plan.zero_blocks):
        raise AdapterMismatch("the plan copies or zeroes KV blocks: vLLM cannot do that")
    if len(plan.state_save_within):
        raise AdapterMismatch(
            "the plan saves states inside a forward: vLLM saves them at block ends only"
        )


def error_output(request: Request, reason: str) -> EngineCoreOutput:
    """A refused request's output: finished with an error, ``reason`` as its stop reason."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=FinishReason.ERROR,
        stop_reason=reason,
    )


NO_PROMPT: tuple[Any, Any] = (None, None)  # no prompt logprobs in a token's output


def token_output(
    request: Request,
    tokens: list[int],
    finish: Any,
    logprobs: Any,
    prompt: tuple[Any, Any] = NO_PROMPT,
) -> EngineCoreOutput:
    """A step's sampled tokens (one, or with speculative decoding the accepted drafts and
    one more) as one output, with the finish, logprobs, events and prefill stats the
    request has, and ``prompt``: the model runner's prompt logprobs (tensors, token-id
    logprobs), which come with the step that ends the prefill (a plain decode token takes
    the short constructor)."""
    events, prefill = request.take_events(), request.take_prefill_stats()
    plain = prompt[0] is None and prompt[1] is None
    if finish is None and logprobs is None and events is None and prefill is None and plain:
        return EngineCoreOutput(request.request_id, tokens)  # the common decode token
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=tokens,
        finish_reason=finish,
        new_logprobs=logprobs,
        new_prompt_logprobs_tensors=prompt[0],
        prompt_token_id_logprobs=prompt[1],
        stop_reason=request.stop_reason,
        events=events,
        prefill_stats=prefill,
    )


def scheduler_stats(
    running: int,
    waiting: int,
    usage: float,
    prefix: PrefixCacheStats,
    connector: tuple[PrefixCacheStats | None, dict[str, Any] | None] = (None, None),
) -> SchedulerStats:
    """``connector``: a KV connector's prefix-cache counts (external hits) and its own
    transfer statistics (``KVConnectorStats.to_dict()``), when one is configured."""
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        kv_cache_usage=usage,
        prefix_cache_stats=prefix,
        connector_prefix_cache_stats=connector[0],
        kv_connector_stats=connector[1],
    )


def kv_events(
    vllm_config: Any, kv_cache_config: Any, block_size: int
) -> tuple[KVEventTranslator, bool, Any]:
    """The translator of kvsched's cache events to vLLM's (tagged with vLLM's KV cache
    groups), whether they are published (``kv_events_config.enable_kv_cache_events``), and
    vLLM's publisher."""
    attention, mamba = cfg.groups(kv_cache_config)
    translator = KVEventTranslator(
        block_size,
        maybe_convert_block_hash,
        {
            "BlockStored": BlockStored,
            "BlockRemoved": BlockRemoved,
            "AllBlocksCleared": AllBlocksCleared,
        },
        EventGroups(attention, tuple(mamba)),
        extra_keys,
    )
    config = getattr(vllm_config, "kv_events_config", None)
    publish = config is not None and config.enable_kv_cache_events
    publisher = EventPublisherFactory.create(
        config, vllm_config.parallel_config.data_parallel_index
    )
    return translator, publish, publisher


def extra_keys(request: Request, first: int, count: int, block_size: int) -> Any:
    """The ``extra_keys`` vLLM's ``BlockPool`` publishes with blocks ``[first, first +
    count)`` of ``request`` (one entry per block; the adapter refuses multimodal inputs and
    LoRA, so only a cache salt, on block 0, is ever set)."""
    keys = [
        generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, 0)[0]
        for i in range(first, first + count)
    ]
    return to_event_extra_keys(keys)


def preempt(request: Request) -> Request:
    """A vLLM request as kvsched's preemption leaves it: preempted, nothing computed."""
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    return request
