"""lmdeploy's side of benchmarks/interleave.py: the anchor's BlockTrie.match() one sample at a time.

Run by interleave.py under the anchor's virtual environment and environment (what
../shared/bench/lmdeploy/run.sh exports: LMDEPLOY_SRC, PYTHONPATH = the anchor's directory,
PYTHONHASHSEED=0, one BLAS/OpenMP thread):

    python benchmarks/lmdeploy_worker.py --mode ssm|ar --batch B --context L [--block-size 64]

The set-up is the anchor's (bench_match.py's main, untimed, with its own ``build`` and
``reserve_and_publish``): B producers of L tokens (``default_rng(0)``) allocated, attached to
the trie (``ssm``: a checkpoint published at step L) and removed, then B consumers (the same
tokens plus token 7). It prints one JSON line describing it, then reads commands from stdin,
one a line: ``sample`` takes one of the anchor's samples (``gc.collect()``, then timed: ``for
seq in consumers: trie.match(seq)``; untimed: the hit check and ``release`` of each consumer)
and prints its milliseconds; end of input exits.
"""

import argparse
import gc
import json
import sys
import time

import bench_match  # the anchor (imports its shim, then lmdeploy's paging code)
import numpy as np
from bench_match import build, release, reserve_and_publish

SCOPE = (
    "lmdeploy 0.18.0 BlockTrie.match() of each of the B consumers (bench_match.py's loop); "
    "gc.collect() before, gc enabled during; untimed after it: the hit check and release"
)


def setup(args):
    """bench_match.main's set-up: the scheduler, its trie, the consumers, the build seconds."""
    rng = np.random.default_rng(0)
    sched = build(args)
    trie = sched.block_trie
    t0 = time.perf_counter()
    prompts = []
    for i in range(args.batch):
        tokens = rng.integers(1, 150000, size=args.context, dtype=np.int64)
        prompts.append(tokens)
        sess = sched.add_session(i)
        prod = sess.add_sequence(tokens)
        sched.block_manager.allocate(prod)
        trie.allocate(prod)
        if args.mode == "ssm":
            reserve_and_publish(trie, prod, args.context)
        sess.remove_sequence(prod)
    build_s = time.perf_counter() - t0
    consumers = []
    for i, tokens in enumerate(prompts):
        sess = sched.add_session(10_000 + i)
        consumers.append(sess.add_sequence(np.concatenate([tokens, [7]])))
    return sched, trie, consumers, build_s


def sample(trie, consumers, context):
    """One of bench_match.main's samples, in milliseconds."""
    gc.collect()
    t = time.perf_counter()
    for seq in consumers:
        trie.match(seq)
    dt = time.perf_counter() - t
    hits = sum(int(seq.num_history_ids == context) for seq in consumers)
    assert hits == len(consumers), f"expected all hits, got {hits}"
    for seq in consumers:
        release(seq)
    return dt * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ssm", "ar"], required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--block-size", type=int, default=64)
    args = p.parse_args()
    assert args.context % args.block_size == 0, "aligned workload: context must be block-aligned"
    sched, trie, consumers, build_s = setup(args)
    ready = {
        "impl": "lmdeploy-0.18.0",
        "anchor": bench_match.__file__,
        "build_s": round(build_s, 2),
        "scope": SCOPE,
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() != "sample":
            print(f"lmdeploy worker: unknown command {line.strip()!r}", file=sys.stderr)
            return 2
        print(repr(sample(trie, consumers, args.context)), flush=True)
    del sched
    return 0


if __name__ == "__main__":
    sys.exit(main())
