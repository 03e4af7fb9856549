"""``kvsched bench vllm``: the scheduler's CPU time per step under vLLM's own structures, vLLM's
default scheduler and kvsched's adapter side by side in one process (needs vLLM).

Setup (not timed): a ``VllmConfig`` for a tiny local model (weights never loaded), a
``KVCacheConfig`` of one full-attention group, N requests of 512 prompt tokens (vLLM's
``Request`` with its sha256 block hasher), stepped until all N are decoding. Timed, per step:
``schedule()`` then ``update_from_output()`` with a ``ModelRunnerOutput`` carrying one token
per request — everything each scheduler does for the step, vLLM's block hashing of the new
tokens (``Request.append_output_token_ids``) in both, kvsched's own identity hashing, input
checks, decisions, plan and translation in the adapter's. The two schedulers alternate by
round; quote the ratio of the same round.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from typing import Any

import numpy as np

from kvsched.bench.stats import summarize

PROMPT = 512
BLOCK = 64


def _configs(running: int, model_dir: str) -> tuple[Any, Any]:
    from kvsched.integrations.vllm.harness import configs

    blocks = running * (PROMPT // BLOCK + 8) + 1
    return configs(model_dir, blocks, max_seqs=running, batched=8192 + running, block_size=BLOCK)


def _requests(running: int) -> list[Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100_000)
    return [
        Request(
            f"r{i}",
            rng.integers(3, 500, PROMPT).tolist(),
            params,
            None,
            block_hasher=hasher,
            arrival_time=float(i),
        )
        for i in range(running)
    ]


def _output(so: Any, sched: Any) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(so.num_scheduled_tokens)
    requests = sched.requests
    sampled = []
    for name in ids:
        r = requests.get(name)
        done = r is not None and r.num_computed_tokens >= r.num_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={n: i for i, n in enumerate(ids)}, sampled_token_ids=sampled
    )


def _step(sched: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    so = sched.schedule()
    t1 = time.perf_counter()
    mro = _output(so, sched)  # the model's part: not timed
    t2 = time.perf_counter()
    sched.update_from_output(so, mro)
    t3 = time.perf_counter()
    return len(so.num_scheduled_tokens), (t1 - t0 + t3 - t2) * 1e3


def measure(kind: str, running: int, samples: int, vllm_config: Any, kv: Any) -> dict[Any, Any]:
    from kvsched.integrations.vllm.harness import make

    sched = make(kind, vllm_config, kv)
    for r in _requests(running):
        sched.add_request(r)
    for _ in range(1000):  # prefill until every request decodes (not timed)
        _step(sched)
        if all(r.num_output_tokens > 0 for r in sched.requests.values()):
            break
    times = []
    for _ in range(samples):
        gc.collect()
        gc.disable()
        try:
            n, ms = _step(sched)
        finally:
            gc.enable()
        if n != running:
            raise RuntimeError(f"{kind}: {n} of {running} requests scheduled in a timed step")
        times.append(ms)
    sched.shutdown()
    return {"impl": kind, **summarize(np.asarray(times))}


def run_vllm_bench(
    running: int = 1024, samples: int = 100, rounds: int = 3
) -> list[dict[str, Any]]:
    from kvsched.integrations.vllm.models import build

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        model = build("qwen3", os.path.join(tmp, "model"))
        vllm_config, kv = _configs(running, str(model))
        out = []
        for round_ in range(1, rounds + 1):
            for kind in ("vllm", "kvsched"):
                out.append(
                    {
                        "round": round_,
                        "running": running,
                        **measure(kind, running, samples, vllm_config, kv),
                    }
                )
    return out
