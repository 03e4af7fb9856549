"""Preset fidelity: a workload run under vLLM's DEFAULT scheduler, then the same arrivals
replayed in kvsched under the ``vllm-align`` checkpoint policy; prefix hits compared request
by request (docs/vllm.md, "The vllm-align preset against vLLM 0.32").

    python -m kvsched.integrations.vllm.fidelity --model DIR --workload junction --out r.json

The vLLM side (needs vLLM) writes vLLM's block size (after its hybrid sizing), KV pool,
token budget and, per request, its batch, prompt, greedy output and ``num_cached_tokens``.
``replay_hits`` (no vLLM needed) builds kvsched's config from those numbers and replays the
arrivals: one batch is one ``LLM.generate`` call (its requests arrive together, in order),
the next batch arrives after the last one finished; the replay's executor returns vLLM's
recorded outputs, so second turns find the states decode left where vLLM found them.

Workloads, sizes in vLLM blocks ``B`` (random token ids, seeded):
* ``junction``: a 3 1/3-block system prompt; eight users one after another, each with a
  question longer than a block (user 1's answer crosses a block boundary); then second
  turns of users 0 and 1 (the first turn, its answer and a new question). vLLM stops the
  second user's chunk at the shared-prefix junction, so from the third user on every one
  hits the whole-block system prompt.
* ``burst``: another system prompt cached by one request, then four users arriving together
  and two more together (vLLM splits the step's token budget between them).
* ``chunked`` (run with a budget of two blocks, ``--batched-tokens``): a 4 1/2-block prompt
  computed in chunks, then two users sharing its first 2 1/2 blocks: is the state at its
  first chunk's end (2 blocks, not its prompt tail) kept?
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import msgspec
import numpy as np

from kvsched.config import Checkpoints, ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events.types import RequestArrived, StepExecuted
from kvsched.gpu.sim import CostModel, SimulatedExecutor
from kvsched.integrations.vllm.models import STATE_DTYPE
from kvsched.plan import StepPlan
from kvsched.replay.runs import replay
from kvsched.replay.workload import Turn, Workload

WORKLOADS = ("junction", "burst", "chunked")
MAX_TOKENS = 16  # every request's output (greedy, ignore_eos)
DECODE_CROSS = 8  # tokens before a block boundary that decode crosses (< MAX_TOKENS)
# Seconds between batches in the replay: a batch of the tiny model finishes in well under a
# simulated second (CostModel), so each batch arrives after the previous one is done.
BATCH_GAP_S = 1000.0


@attrs.frozen
class Ask:
    """One request of a workload: its own tokens, appended to the prompt, answer and
    question of ``follows`` (a second turn) when given."""

    name: str
    tokens: tuple[int, ...]
    follows: str = ""


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    """``n`` seeded token ids (3..499: no special tokens of the tiny models)."""
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, 500, n))


def _question(block: int, seed: int) -> int:
    """A question length between 1.1 and 2 blocks (longer than a block)."""
    return int(np.random.default_rng(seed).integers(block * 11 // 10, block * 2))


def junction(block: int) -> list[list[Ask]]:
    """Sequential users of one long system prompt, then two second turns; user 1's prompt
    ends ``DECODE_CROSS`` tokens before a block boundary, so its answer crosses it."""
    system = _tokens(3 * block + block // 3, 2601)
    sizes = [_question(block, 2610 + i) for i in range(8)]
    sizes[1] = 5 * block - len(system) - DECODE_CROSS
    users = [[Ask(f"user-{i}", system + _tokens(n, 2620 + i))] for i, n in enumerate(sizes)]
    again = [
        [Ask(f"user-{i}-turn-2", _tokens(block // 4 + 7 * i, 2640 + i), f"user-{i}")]
        for i in (0, 1)
    ]
    return users + again


def burst(block: int) -> list[list[Ask]]:
    """One request caches a system prompt, then users arrive four and two at a time."""
    system = _tokens(2 * block + block // 2, 2701)
    first = [Ask("warm", system + _tokens(_question(block, 2703), 2702))]
    four = [
        Ask(f"burst-{i}", system + _tokens(_question(block, 2710 + i), 2720 + i)) for i in range(4)
    ]
    two = [
        Ask(f"pair-{i}", system + _tokens(_question(block, 2730 + i), 2740 + i)) for i in range(2)
    ]
    return [first, four, two]


def chunked(block: int) -> list[list[Ask]]:
    """A long prompt computed in chunks, then two users of its first 2 1/2 blocks."""
    long = _tokens(4 * block + block // 2, 2801)
    shared = long[: 2 * block + block // 2]
    users = [[Ask(f"user-{i}", shared + _tokens(block // 4, 2810 + i))] for i in range(2)]
    return [[Ask("long", long)], *users]


def batches(workload: str, block: int) -> list[list[Ask]]:
    """The named workload's batches for vLLM block size ``block``."""
    return {"junction": junction, "burst": burst, "chunked": chunked}[workload](block)


# --------------------------------------------------------------------------- vLLM side


def _env() -> None:
    """vLLM in-process on this machine's CPU (as ``run.py``; docs/vllm.md)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _llm(model: str, max_model_len: int, max_seqs: int, blocks: int, batched: int = 0) -> Any:
    from vllm import LLM

    extra = {"num_gpu_blocks_override": blocks} if blocks else {}
    return LLM(
        **extra,
        model=model,
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched or max_model_len,
        max_num_seqs=max_seqs,
        enable_prefix_caching=True,
        seed=0,
        skip_tokenizer_init=True,
        mamba_ssm_cache_dtype=STATE_DTYPE,
    )


def _engine_sizes(llm: Any) -> dict[str, int]:
    """vLLM's block size (after hybrid sizing), pool size and budgets, read from its core."""
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    config = llm.llm_engine.vllm_config
    kinds = [type(g.kv_cache_spec).__name__ for g in sched.kv_cache_config.kv_cache_groups]
    return {
        "mamba_groups": kinds.count("MambaSpec"),
        "block_size": int(config.cache_config.block_size),
        "num_blocks": int(sched.kv_cache_config.num_blocks),
        "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
        "max_num_seqs": int(config.scheduler_config.max_num_seqs),
        "max_model_len": int(config.model_config.max_model_len),
    }


def run_vllm(
    model: str,
    workload: str,
    max_model_len: int = 4096,
    max_seqs: int = 8,
    blocks: int = 0,
    batched: int = 0,
) -> dict[str, Any]:
    """The workload under vLLM's default scheduler: sizes and each request's record
    (``batched``: the per-step token budget, default the whole context)."""
    from vllm import SamplingParams, TokensPrompt

    llm = _llm(model, max_model_len, max_seqs, blocks, batched)
    sizes = _engine_sizes(llm)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    done: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for index, batch in enumerate(batches(workload, sizes["block_size"])):
        prompts = [_prompt(ask, done) for ask in batch]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        for ask, prompt, r in zip(batch, prompts, outs, strict=True):
            done[ask.name] = {
                "batch": index,
                "prompt": prompt,
                "tokens": list(r.outputs[0].token_ids),
                "cached": int(r.num_cached_tokens or 0),
            }
    return {
        "workload": workload,
        "sizes": sizes,
        "wall_s": time.perf_counter() - t0,
        "requests": done,
    }


def _prompt(ask: Ask, done: dict[str, dict[str, Any]]) -> list[int]:
    """The request's prompt: its tokens, after the earlier turn's prompt and answer."""
    if not ask.follows:
        return list(ask.tokens)
    prev = done[ask.follows]
    return list(prev["prompt"]) + list(prev["tokens"]) + list(ask.tokens)


# ------------------------------------------------------------------------ kvsched side


class RecordedOutputs:
    """An executor answering each sequence with vLLM's recorded greedy output (the token at
    output position ``end - prompt length``); step durations from the cost model."""

    def __init__(self, prompts: dict[int, int], outputs: dict[int, list[int]], vocab: int) -> None:
        self._prompts = prompts
        self._outputs = outputs
        self._sim = SimulatedExecutor(vocab, CostModel())

    def execute(self, plan: StepPlan) -> StepExecuted:
        """The simulated step with the recorded tokens in place of sampled ones."""
        done = self._sim.execute(plan)
        tokens = [
            self._outputs[int(s)][int(e) - self._prompts[int(s)]]
            for s, e in zip(done.seq_ids, plan.ends[plan.sample], strict=True)
        ]
        return msgspec.structs.replace(done, tokens=np.asarray(tokens, dtype=done.tokens.dtype))

    def sleep(self, level: int) -> None:
        self._sim.sleep(level)

    def wake(self) -> None:
        self._sim.wake()


def replay_config(sizes: dict[str, int], vocab: int, policy: str = "vllm-align") -> SchedulerConfig:
    """kvsched's config for vLLM's sizes under a checkpoint policy: vLLM's block size, its
    whole pool as KV blocks, and as many checkpoints as the whole pool holds (a state takes
    a block of each mamba group); vLLM's states and KV blocks compete for the one pool,
    kvsched counts them apart, so each may use all of it. The token budget less one token
    per row for decodes, as the adapter's ``config.py`` derives it."""
    budget = sizes["num_blocks"] // max(1, sizes.get("mamba_groups", 1))
    return SchedulerConfig(
        model=ModelSpec(name="fidelity", vocab_size=vocab, max_context=sizes["max_model_len"]),
        block_size=sizes["block_size"],
        num_blocks=sizes["num_blocks"],
        max_batch=sizes["max_num_seqs"],
        max_prefill_tokens=sizes["max_num_batched_tokens"] - sizes["max_num_seqs"],
        hybrid=True,
        checkpoints=Checkpoints(budget=budget),
    ).with_checkpoint_policy(policy)


def _turns(requests: dict[str, dict[str, Any]]) -> Iterator[Turn]:
    for seq_id, r in enumerate(requests.values()):
        req = RequestArrived(
            seq_id=seq_id,
            prompt=np.asarray(r["prompt"], dtype=np.int32),
            max_tokens=len(r["tokens"]),
            arrival_time=0.0,
        )
        yield Turn(req, arrival_s=r["batch"] * BATCH_GAP_S)


def replay_hits(result: dict[str, Any], vocab: int, policy: str = "vllm-align") -> dict[str, int]:
    """Each request's prompt tokens hit when kvsched replays vLLM's arrivals (``run_vllm``'s
    record) under ``policy``."""
    requests = result["requests"]
    config = replay_config(result["sizes"], vocab, policy)
    records = list(requests.values())
    executor = RecordedOutputs(
        {i: len(r["prompt"]) for i, r in enumerate(records)},
        {i: r["tokens"] for i, r in enumerate(records)},
        vocab,
    )
    run = replay(Engine(config), executor, Workload("fidelity", tuple(_turns(requests))))
    return {name: int(run.recorder.hit[i]) for i, name in enumerate(requests)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", choices=WORKLOADS, default="junction")
    p.add_argument("--out", required=True)
    p.add_argument("--blocks", type=int, default=0, help="vLLM's KV pool (0: its own sizing)")
    p.add_argument(
        "--batched-tokens", type=int, default=0, help="per-step token budget (0: the context)"
    )
    args = p.parse_args(argv)
    _env()
    result = run_vllm(args.model, args.workload, blocks=args.blocks, batched=args.batched_tokens)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
