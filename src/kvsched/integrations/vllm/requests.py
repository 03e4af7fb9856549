"""vLLM requests as kvsched inputs, and the stop rule both sides apply (no vLLM import here).

Identity: by default kvsched hashes the prompt itself (its own namespace-rooted chain, the
same as in every other kvsched run) and uses ``Request.block_hashes`` only to name blocks in
vLLM's KV-events schema (``kv_events.py``), so a router that hashes prompts the vLLM way can
follow the cache. With the adapter option ``block_hashes: "vllm"`` the prompt's full blocks
take vLLM's digests instead (``vllm_block_hashes``: each truncated or zero-padded to 16
bytes), which saves hashing the prompt twice; blocks filled by decoding are then hashed by
kvsched (vLLM's digests of them are not known at arrival), so a later prompt that repeats
an earlier output hits only up to that output.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from kvsched.events import types as ev


def refusal(request: Any) -> str | None:
    """Why the adapter cannot serve this request (None: it can)."""
    params = request.sampling_params
    if params is None:
        return "pooling requests are not supported by the kvsched adapter"
    if request.prompt_token_ids is None:
        return "prompt embeddings are not supported by the kvsched adapter"
    reason = params_refusal(params)
    if reason is not None:
        return reason
    if request.max_tokens is None or request.max_tokens < 1:
        return f"max_tokens must be at least 1, got {request.max_tokens}"
    return None


def params_refusal(params: Any) -> str | None:
    """Why the adapter cannot serve a request with these ``SamplingParams`` (None: it can).
    vLLM's front end asks this before the request reaches the engine (``RequestCheck``); a
    request with ``n > 1`` is split there into ``n`` requests, each served."""
    detection = getattr(params, "repetition_detection", None)
    if detection is not None and detection.max_pattern_size > 0:
        return "repetition detection is not supported by the kvsched adapter"
    return None


def spans_of(request: Any) -> tuple[ev.MultimodalSpan, ...]:
    """A request's multimodal items as kvsched spans: each item's placeholder positions,
    named by vLLM's identifier of the item (its content hash; with a LoRA's name where one
    applies), which enters the identity of every block the span overlaps."""
    return tuple(
        ev.MultimodalSpan(
            int(f.mm_position.offset),
            int(f.mm_position.offset) + int(f.mm_position.length),
            str(f.identifier).encode(),
        )
        for f in request.mm_features or ()
    )


def vllm_block_hashes(request: Any) -> bytes:
    """vLLM's digests of the request's full blocks, packed as kvsched's 16-byte digests."""
    size = ev.HASH_SIZE
    return b"".join(bytes(h)[:size].ljust(size, b"\0") for h in request.block_hashes)


def arrival(
    request: Any, seq_id: int, t0: float, use_block_hashes: bool = False
) -> ev.RequestArrived:
    """The kvsched arrival of a vLLM request. vLLM's priority is "lower value first",
    kvsched's "higher first": the sign flips. ``eos_token_id`` is -1 under ``ignore_eos``.
    ``skip_reading_prefix_cache`` (vLLM sets it for prompt logprobs, so that every prompt
    position is computed) becomes ``skip_prefix_hit``.
    ``use_block_hashes``: the prompt's blocks keep vLLM's digests (``vllm_block_hashes``).
    A LoRA request's adapter is its LoRA's name, part of its blocks' identity (as in vLLM's
    block hashes) and counted against ``model.max_adapters`` (vLLM's ``max_loras``)."""
    params = request.sampling_params
    eos = params.eos_token_id
    lora = request.lora_request
    return ev.RequestArrived(
        seq_id=seq_id,
        prompt=np.asarray(request.prompt_token_ids, dtype=np.int32),
        max_tokens=int(request.max_tokens),
        arrival_time=max(0.0, float(request.arrival_time) - t0),
        priority=-int(request.priority),
        adapter=lora.lora_name if lora is not None and lora.lora_int_id > 0 else "",
        cache_salt=request.cache_salt or "",
        eos_token_id=-1 if eos is None else int(eos),
        temperature=float(params.temperature),
        seed=int(params.seed) if params.seed is not None else 0,
        block_hashes=vllm_block_hashes(request) if use_block_hashes else b"",
        skip_prefix_hit=bool(getattr(request, "skip_reading_prefix_cache", False)),
        mm_spans=spans_of(request),
    )


class StopRule(NamedTuple):
    """vLLM's stop check for one request, read once at arrival. ``min_tokens`` needs nothing
    here: vLLM 0.32's ``check_stop`` tests eos, stop tokens and length before it (it only
    delays repetition detection, which the adapter refuses), and the sampler's min-tokens
    logits processor keeps eos and stop tokens from being sampled before it."""

    eos: int  # -1: none (``ignore_eos``)
    stop_tokens: frozenset[int]
    max_output: int  # output tokens at which it ends: max_tokens, or the context's end


def stop_rule(request: Any, max_model_len: int) -> StopRule:
    params = request.sampling_params
    eos = params.eos_token_id
    room = max_model_len - len(request.prompt_token_ids)
    return StopRule(
        -1 if eos is None else int(eos),
        frozenset(params.stop_token_ids or ()),
        min(int(request.max_tokens), room),
    )


def stop_reason(rule: StopRule, token: int, num_output: int) -> tuple[str, int | None] | None:
    """vLLM's stop check after ``token`` became output token ``num_output``: (kvsched-style
    reason, stop token) or None, in vLLM's order (eos, stop tokens, length). "stop" (eos) and
    "length" (max_tokens, context) are kvsched's own finish rules; a ``stop_token_ids`` hit is
    vLLM's only, and the adapter turns it into an abort."""
    if token == rule.eos:
        return "stop", None
    if rule.stop_tokens and token in rule.stop_tokens:
        return "stop_token", token
    if num_output >= rule.max_output:
        return "length", None
    return None


class Registry:
    """Every vLLM request kvsched holds, until kvsched retires its sequence: vLLM name <->
    kvsched id, its stop rule, whether it has a structured output."""

    def __init__(self, max_model_len: int, t0: float, use_block_hashes: bool) -> None:
        self.max_model_len = max_model_len
        self.t0 = t0  # (arrival times are relative to the adapter's start)
        self.use_block_hashes = use_block_hashes
        self.seq_of: dict[str, int] = {}
        self.req_of: dict[int, Any] = {}
        self.stops: dict[int, StopRule] = {}
        self.structured: set[int] = set()  # live sequences with a structured output
        self.cached: dict[int, int] = {}  # num_cached_tokens given to vLLM per sequence
        self._next_id = 0

    def arrive(self, request: Any) -> ev.RequestArrived:
        """A new kvsched id for ``request``; its ``RequestArrived``."""
        self._next_id += 1
        seq_id = self._next_id
        if request.use_structured_output:
            self.structured.add(seq_id)
        self.seq_of[request.request_id] = seq_id
        self.stops[seq_id] = stop_rule(request, self.max_model_len)
        self.req_of[seq_id] = request
        return arrival(request, seq_id, self.t0, self.use_block_hashes)

    def forget(self, seq_id: int) -> Any:
        """Drop a retired sequence; returns its request."""
        request = self.req_of.pop(seq_id)
        self.stops.pop(seq_id, None)
        self.structured.discard(seq_id)
        if self.seq_of.get(request.request_id) == seq_id:  # (a name may be reused later)
            del self.seq_of[request.request_id]
        return request

    def cached_mismatch(self, seq_ids: list[int], *counts: Any) -> str | None:
        """Why retired sequences' cached-token counts (``counts``: one column per kind, local,
        checkpoint, external) differ from those vLLM was given at admission; None if equal."""
        for i, seq_id in enumerate(seq_ids):
            total = sum(int(c[i]) for c in counts)
            given = self.cached.pop(seq_id, 0)
            if total != given:
                return f"sequence {seq_id}: {total} cached tokens retired, {given} given to vLLM"
        return None
