"""Run an offline workload on vLLM, under vLLM's own scheduler or kvsched's:

    python -m kvsched.integrations.vllm.run --model DIR --scheduler kvsched --out out.json \\
        [--workload mixed|preempt|decode] [--log run.kvlog] [--kv-events tcp://127.0.0.1:PORT]
        [--async-scheduling]

Workloads (token ids, greedy, ``ignore_eos``):
* ``mixed``: prompts sharing a long prefix (one first, the rest after it is cached), a
  stop token (with sample logprobs) and the same stop token under ``min_tokens``, prompt
  logprobs of a prompt whose prefix is cached, a
  three-turn conversation (each turn the previous prompt, its answer and new tokens), a prompt
  longer than the per-step token budget (chunked prefill), a request with ``n=3`` (seeded
  sampling; attention models only) and a request aborted mid-decode.
* ``preempt``: more concurrent work than the KV cache holds (``--blocks``), forcing preemption.
* ``decode``: ``--running`` requests decoding together (the scheduler benchmark's shape).
* ``chat``: branching users in bursts, second turns (``workloads.py``; with a small
  ``--blocks``, the memory-pressure workload).
* ``popular`` (hybrid): a popular shared prefix, strangers, the prefix again
  (``workloads.py``; with a small ``--blocks``, the state-pressure workload).
The JSON has each request's tokens, its cached prompt tokens, the wall time and, for kvsched,
its prefix-cache counters.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.integrations.vllm.cpu_async import keep_async_scheduling_on_cpu
from kvsched.integrations.vllm.models import STATE_DTYPE
from kvsched.integrations.vllm.workloads import CHAT_SIZES, POPULAR_SIZES, chat, popular

SCHEDULER = "kvsched.integrations.vllm.Scheduler"
REQUEST_CHECK = "kvsched.integrations.vllm:RequestCheck"  # refusals in vLLM's front end

# Default per-step token budget and context (``--batched-tokens``, ``--max-model-len``). A
# hybrid model's block is its state page, which vLLM sets only once the model is built (640
# tokens for the tiny Qwen3-Next; the budget must hold a block plus a token per running
# request): its budget is the whole context, which holds a block whenever a request can.
DEFAULTS = {"attention": (256, 2048), "hybrid": (4096, 4096)}


def budgets(args: argparse.Namespace) -> tuple[int, int]:
    """(max_num_batched_tokens, max_model_len): the options given, else the defaults."""
    batched, length = DEFAULTS["hybrid" if args.hybrid else "attention"]
    if args.max_model_len is not None:
        length = args.max_model_len
        batched = batched if not args.hybrid else length
    return (batched if args.batched_tokens is None else args.batched_tokens), length


def _env() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM

    batched, length = budgets(args)
    kw: dict[str, Any] = {
        "model": args.model,
        "enforce_eager": True,
        "max_model_len": length,
        "max_num_batched_tokens": batched,
        "max_num_seqs": args.max_seqs,
        "enable_prefix_caching": True,
        "seed": 0,
        "skip_tokenizer_init": True,
    }
    if not args.hybrid:
        kw["block_size"] = 32
        kw["dtype"] = "float32"
    else:  # (models.STATE_DTYPE: the same block size on every CPU)
        kw["mamba_ssm_cache_dtype"] = STATE_DTYPE
    if args.blocks:
        kw["num_gpu_blocks_override"] = args.blocks
    if args.async_scheduling:  # (vLLM's CPU build turns it off: cpu_async.py)
        keep_async_scheduling_on_cpu()
        kw["async_scheduling"] = True
    if args.scheduler == "kvsched":
        kw["scheduler_cls"] = SCHEDULER
        kw["logits_processors"] = [REQUEST_CHECK]
        extra: dict[str, Any] = {"check_invariants": not args.no_check}
        if args.log:
            extra["log"] = args.log
        if args.vllm_block_hashes:
            extra["block_hashes"] = "vllm"
        kw["additional_config"] = {"kvsched": extra}
    if args.kv_events:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=args.kv_events
        )
    return LLM(**kw)


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def _generate(
    llm: Any, prompts: dict[str, list[int]], max_tokens: int, out: dict[str, Any], **kw: Any
) -> None:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kw)
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts.values()], params, use_tqdm=False
    )
    for name, r in zip(prompts, results, strict=True):
        out[name] = {"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens or 0}
        if r.prompt_logprobs:  # per prompt position: (token, logprob) pairs (first: none)
            out[name]["prompt_logprobs"] = [
                sorted((int(t), round(float(p.logprob), 4)) for t, p in lp.items())
                for lp in r.prompt_logprobs
                if lp
            ]


def _aborted(llm: Any, out: dict[str, Any]) -> None:
    """Two requests; one aborted once it has produced 4 tokens."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48)
    engine.add_request("abort-me", TokensPrompt(prompt_token_ids=_tokens(90, 7)), params)
    engine.add_request("abort-peer", TokensPrompt(prompt_token_ids=_tokens(60, 8)), params)
    got: dict[str, list[int]] = {"abort-me": [], "abort-peer": []}
    aborted = False
    while engine.has_unfinished_requests():
        for r in engine.step():
            got[r.request_id] = list(r.outputs[0].token_ids)
        if not aborted and len(got["abort-me"]) >= 4:
            engine.abort_request(["abort-me"])
            aborted = True
    out["abort-me"] = {"tokens": got["abort-me"], "cached": 0, "aborted": True}
    out["abort-peer"] = {"tokens": got["abort-peer"], "cached": 0}


# Prompt sizes of the mixed workload: attention models (block 32), hybrid (block 544, the
# state page): shared prefix, first turn, new tokens per turn, the long prompt.
SIZES = {"attention": (320, 100, 40, 900), "hybrid": (1200, 600, 500, 2500)}


def mixed(
    llm: Any, out: dict[str, Any], sizes: tuple[int, int, int, int], parallel: bool = False
) -> None:
    shared, first, more, long = sizes
    prefix = _tokens(shared, 1)
    _generate(llm, {"prefix-0": prefix + _tokens(16, 100)}, 16, out)
    _generate(llm, {f"prefix-{i}": prefix + _tokens(16, 100 + i) for i in (1, 2, 3)}, 16, out)
    # A stop token (the 6th token of prefix-0's answer), with sample logprobs.
    stop = out["prefix-0"]["tokens"][5]
    _generate(
        llm, {"stop-token": prefix + _tokens(16, 100)}, 16, out, stop_token_ids=[stop], logprobs=2
    )
    # min_tokens: the same stop token, masked by the sampler for the first 10 tokens.
    _generate(
        llm,
        {"min-tokens": prefix + _tokens(16, 100)},
        16,
        out,
        stop_token_ids=[stop],
        min_tokens=10,
    )
    # prompt logprobs: vLLM reads no cached prefix for it (skip_reading_prefix_cache)
    _generate(llm, {"prompt-logprobs": prefix + _tokens(16, 101)}, 4, out, prompt_logprobs=0)
    assert llm.reset_prefix_cache(), "reset_prefix_cache refused with nothing running"
    _generate(llm, {"after-reset": prefix + _tokens(16, 104)}, 8, out)  # must miss
    history = _tokens(first, 2)
    for turn in range(3):
        name = f"turn-{turn}"
        _generate(llm, {name: history}, 12, out)
        history = history + out[name]["tokens"] + _tokens(more, 200 + turn)
    _generate(llm, {"long": _tokens(long, 3)}, 8, out)
    if parallel:
        _parallel(llm, out)
    _aborted(llm, out)


def _parallel(llm: Any, out: dict[str, Any]) -> None:
    """One request with ``n=3`` (seeded sampling): vLLM's front end splits it in three."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(n=3, temperature=1.0, seed=11, ignore_eos=True, max_tokens=8)
    (r,) = llm.generate([TokensPrompt(prompt_token_ids=_tokens(40, 9))], params, use_tqdm=False)
    for i, o in enumerate(r.outputs):
        out[f"parallel-{i}"] = {"tokens": list(o.token_ids), "cached": r.num_cached_tokens or 0}


def preempt(llm: Any, out: dict[str, Any], prompt: int) -> None:
    _generate(llm, {f"p-{i}": _tokens(prompt, 300 + i) for i in range(6)}, 96, out)


def decode(llm: Any, out: dict[str, Any], running: int) -> None:
    _generate(llm, {f"d-{i}": _tokens(32, 400 + i) for i in range(running)}, 32, out)


def in_process_core(engine: Any) -> Any | None:
    """A vLLM ``LLMEngine``'s engine core, if it runs in this process (None: another)."""
    return getattr(getattr(engine, "engine_core", None), "engine_core", None)


def kvsched_scheduler(llm: Any) -> Any | None:
    sched = getattr(in_process_core(llm.llm_engine), "scheduler", None)
    return sched if type(sched).__module__.startswith("kvsched.") else None


def _engine_info(llm: Any) -> dict[str, Any]:
    """How vLLM's engine ran: async scheduling on, the engine core's batch queue (2: its
    asynchronous loop, ``step_with_batch_queue``), the scheduler class."""
    core = in_process_core(llm.llm_engine)
    return {
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "batch_queue_size": getattr(core, "batch_queue_size", None),
        "scheduler": type(getattr(core, "scheduler", None)).__name__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--scheduler", choices=["vllm", "kvsched"], default="kvsched")
    p.add_argument(
        "--workload", choices=["mixed", "preempt", "decode", "chat", "popular"], default="mixed"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--log", default=None)
    p.add_argument("--kv-events", default=None)
    p.add_argument("--hybrid", action="store_true")
    p.add_argument("--blocks", type=int, default=0, help="KV cache blocks (0: vLLM's sizing)")
    p.add_argument(
        "--batched-tokens",
        type=int,
        default=None,
        help="max_num_batched_tokens (default: 256; --hybrid: the context length)",
    )
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=None, help="default: 2048; --hybrid: 4096")
    p.add_argument("--running", type=int, default=64)
    p.add_argument("--no-check", action="store_true", help="skip kvsched's invariant checks")
    p.add_argument(
        "--vllm-block-hashes", action="store_true", help="kvsched keeps vLLM's prompt digests"
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's async scheduling (its GPU default; kept on for vLLM's CPU build by "
        "cpu_async.py)",
    )
    args = p.parse_args(argv)
    _env()
    llm = make_llm(args)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if args.workload == "mixed":
        mixed(llm, out, SIZES["hybrid" if args.hybrid else "attention"], not args.hybrid)
    elif args.workload == "chat":
        chat(llm, out, CHAT_SIZES["hybrid" if args.hybrid else "attention"])
    elif args.workload == "popular":
        popular(llm, out, POPULAR_SIZES)
    elif args.workload == "preempt":
        preempt(llm, out, 1240 if args.hybrid else 160)  # (decode grows a block)
    else:
        decode(llm, out, args.running)
    wall = time.perf_counter() - t0
    sched = kvsched_scheduler(llm)
    info: dict[str, Any] = {"wall_s": wall, "requests": out, "engine": _engine_info(llm)}
    if sched is not None:
        stats = sched.engine.state.stats
        info["kvsched"] = {
            "hit_tokens": stats.hit_tokens,
            "query_tokens": stats.query_tokens,
            "preemptions": stats.preemptions,
            "block_evictions": sched.engine.state.pool.num_evictions,
            "checkpoint_evictions": sched.engine.state.ckpts.evictions,
            "steps": stats.steps,
        }
        if args.kv_events:
            names = sched.cached_names()
            info["kvsched"]["cached_names"] = names["blocks"]
            info["kvsched"]["checkpoint_names"] = names["checkpoints"]
        sched.shutdown()
    Path(args.out).write_text(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
