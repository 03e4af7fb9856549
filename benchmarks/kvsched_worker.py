"""kvsched's side of benchmarks/interleave.py: ``bench admit`` (or ``match``) one sample at a time.

    python3 benchmarks/kvsched_worker.py --what admit|match --mode ssm|ar --batch B --context L

Does the benchmark's untimed set-up (``AdmitSampler`` / ``MatchSampler``), prints one JSON line
describing it, then reads commands from stdin, one a line: ``sample`` takes one sample (the
timed scope of ``kvsched bench admit`` / ``match``, then its untimed undo) and prints its
milliseconds; end of input exits. Run by interleave.py, which alternates its samples with
lmdeploy's (benchmarks/lmdeploy_worker.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvsched import identity
from kvsched.bench.admit import AdmitSampler
from kvsched.bench.match import MatchSampler

SCOPES = {
    "admit": "one Engine.step in which the B consumers arrive and are admitted with their "
    "whole hit (input checks, arrival folds and block identity, ordering, admission, "
    "one-token prefill chunks, plan, decision folds); gc.collect() before, gc paused during; "
    "untimed after it: the step that finishes them (kvsched bench admit)",
    "match": "Policy.find_prefix + attach_prefix of each of the B consumers (identities "
    "computed at arrival, untimed); gc.collect() before, gc paused during; untimed after it: "
    "their preemption (kvsched bench match)",
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["admit", "match"], default="admit")
    p.add_argument("--mode", choices=["ar", "ssm"], required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--block-size", type=int, default=64)
    args = p.parse_args()
    kind = AdmitSampler if args.what == "admit" else MatchSampler
    sampler: AdmitSampler | MatchSampler = kind(
        mode=args.mode, batch=args.batch, context=args.context, block_size=args.block_size
    )
    ready = {
        "impl": "kvsched",
        "bench": args.what,
        "build_s": round(sampler.build_s, 2),
        "identity": sampler.engine.config.identity,
        "native_identity": identity._kvs128 is not None,
        "scope": SCOPES[args.what],
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() != "sample":
            print(f"kvsched worker: unknown command {line.strip()!r}", file=sys.stderr)
            return 2
        print(repr(sampler.sample()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
