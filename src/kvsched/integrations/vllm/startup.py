"""The adapter's start-up: the checks before it serves (the vLLM release, the config, the
event log, what vLLM runs that costs it)."""

from __future__ import annotations

import logging
from typing import Any

import vllm

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine, create_log
from kvsched.integrations.vllm import config as cfg
from kvsched.integrations.vllm.encoders import encoder_budget

logger = logging.getLogger("kvsched.integrations.vllm.scheduler")


def start(
    vllm_config: Any, kv_cache_config: Any, block_size: int, mm_registry: Any = None
) -> tuple[dict[str, Any], SchedulerConfig, Engine, int]:
    """The adapter's options, kvsched's config, its engine (writing the event log the
    options name) and the size of vLLM's encoder cache (0: a text-only model), after the
    start-up checks: the vLLM release, the config, the log path."""
    opts = cfg.options(vllm_config)
    untested = cfg.check_vllm_version(vllm.__version__, opts["allow_untested_vllm"])
    if untested:
        logger.warning("kvsched: %s", untested)
    compute, cache_size = encoder_budget(vllm_config, mm_registry)
    config = cfg.scheduler_config(vllm_config, kv_cache_config, block_size, compute)
    path = opts.get("log")
    if path:
        cfg.check_log_path(path, opts["overwrite_log"])
    log = create_log(path, config) if path else None
    engine = Engine(config, log=log, check_invariants=bool(opts.get("check_invariants")))
    if not cfg.has_request_check(vllm_config):
        logger.warning(
            "kvsched: requests the adapter refuses (repetition detection) "
            "will fail with an internal error; add --logits-processors %s "
            "(LLM(logits_processors=[...])) to refuse them up front with the reason",
            "kvsched.integrations.vllm:RequestCheck",
        )
    return opts, config, engine, cache_size

