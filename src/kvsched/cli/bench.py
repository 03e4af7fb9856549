"""``kvsched bench``: the match, admit, identity, step and vLLM benchmarks."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvsched.cli.checks import (
    check_output,
    fail,
)
from kvsched.cli.options import COUNT, DEFAULT, int_in
from kvsched.config import (
    IDENTITY_SCHEMES,
    MAX_BATCH,
)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench in ("match", "admit"):
        from kvsched.bench.admit import run_admit_bench
        from kvsched.bench.match import run_match_bench

        run = run_match_bench if args.bench == "match" else run_admit_bench
        try:
            out = run(
                mode=args.mode,
                batch=args.batch,
                context=args.context,
                block_size=args.block_size,
                warmup=args.warmup,
                samples=args.samples,
            )
        except ValueError as exc:
            return fail(str(exc))
    elif args.bench == "identity":
        from kvsched.bench.identity import run_identity_bench

        out = run_identity_bench(
            context=args.context,
            block_size=args.block_size,
            scheme=args.scheme,
            warmup=args.warmup,
            samples=args.samples,
        )
    elif args.bench == "vllm":
        return _bench_vllm(args)
    else:
        from kvsched.bench.step import run_step_bench

        check_output("--log", args.log, args.overwrite)
        try:
            out = run_step_bench(
                running=args.running,
                warmup=args.warmup,
                samples=args.samples,
                event_log=args.event_log,
                log_path=args.log,
                progress=not args.json,
            )
        except OSError as exc:  # --log PATH cannot be written (events.log.LogOpenError)
            return fail(str(exc))
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"  {key:<12}{value}")
    return 0


def _bench_vllm(args: argparse.Namespace) -> int:
    try:  # vLLM first: nothing is written (the bench's model) without it
        importlib.import_module("vllm")
        from kvsched.integrations.vllm.bench import run_vllm_bench
    except ImportError as exc:
        return fail(
            f"kvsched bench vllm needs vLLM, which {sys.executable} cannot import ({exc}); "
            "build its environment with scripts/vllm_env.sh, then run "
            ".venv-vllm/bin/kvsched bench vllm"
        )
    rows = []
    for running in args.running:
        rows += run_vllm_bench(
            running=running,
            samples=args.samples,
            rounds=args.rounds,
            order=args.order,
            drafts=args.drafts,
            heap=args.heap,
        )
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


def add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks (prefix match, scheduler step)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, what in (
        ("match", "prefix match on lmdeploy's aligned exact-hit workload"),
        ("admit", "one Engine.step admitting B cached requests (identity and all; same workload)"),
    ):
        match = kinds.add_parser(name, help=what)
        match.add_argument(
            "--mode", choices=["ar", "ssm"], default="ar", help="attention or hybrid" + DEFAULT
        )
        match.add_argument(
            "--batch", type=int_in(1, MAX_BATCH), default=128, help="requests" + DEFAULT
        )
        match.add_argument(
            "--context", type=int_in(1, 1 << 24), default=65536, help="tokens each" + DEFAULT
        )
        match.add_argument(
            "--block-size", type=int_in(1, 1 << 16), default=64, help="tokens" + DEFAULT
        )
        match.add_argument(
            "--warmup", type=int_in(0, 1 << 20), default=2, help="untimed runs" + DEFAULT
        )
        match.add_argument("--samples", type=COUNT, default=10, help="timed runs" + DEFAULT)
        match.add_argument("--json", action="store_true")
    ident = kinds.add_parser(
        "identity", help="block identity of one prompt, beside one numpy.array_equal pass"
    )
    ident.add_argument(
        "--context", type=int_in(1, 1 << 24), default=65536, help="prompt tokens" + DEFAULT
    )
    ident.add_argument("--block-size", type=int_in(1, 1 << 16), default=64, help="tokens" + DEFAULT)
    ident.add_argument(
        "--scheme", choices=IDENTITY_SCHEMES, default="kvs128", help="block identity" + DEFAULT
    )
    ident.add_argument(
        "--warmup", type=int_in(0, 1 << 20), default=20, help="untimed runs" + DEFAULT
    )
    ident.add_argument("--samples", type=COUNT, default=500, help="timed runs" + DEFAULT)
    ident.add_argument("--json", action="store_true")
    step = kinds.add_parser("step", help="one scheduler step with N running decode sequences")
    step.add_argument(
        "--running", type=int_in(1, MAX_BATCH), default=1024, help="sequences" + DEFAULT
    )
    step.add_argument(
        "--warmup", type=int_in(0, 1 << 20), default=5, help="untimed steps" + DEFAULT
    )
    step.add_argument("--samples", type=COUNT, default=200, help="timed steps" + DEFAULT)
    step.add_argument(
        "--event-log",
        action="store_true",
        help="the engine writes its event log (a temporary file, deleted afterwards): the "
        "timed step includes the plan digest, the record's encoding and the write",
    )
    step.add_argument(
        "--log", metavar="PATH", help="write the event log to PATH, kept (implies --event-log)"
    )
    step.add_argument("--overwrite", action="store_true", help="replace an existing --log PATH")
    step.add_argument("--json", action="store_true")
    vllm = kinds.add_parser(
        "vllm", help="schedule + update_from_output per step: vLLM's scheduler vs kvsched's"
    )
    vllm.add_argument(
        "--running",
        type=int_in(1, MAX_BATCH),
        nargs="+",
        default=[256, 1024],
        help="running sequences, one row each" + DEFAULT,
    )
    vllm.add_argument("--samples", type=COUNT, default=100, help="timed steps" + DEFAULT)
    vllm.add_argument(
        "--order",
        choices=["sync", "async"],
        default="sync",
        help="vLLM's call order: synchronous, or async scheduling (vLLM's AsyncScheduler "
        "against the adapter; a sample is one step with work)" + DEFAULT,
    )
    vllm.add_argument(
        "--heap",
        choices=["engine", "cold"],
        default="engine",
        help="engine: the collector frozen after set-up and on during steps, as vLLM's engine "
        "core runs; cold: a full collection before each step, timed with the collector off "
        "(cold CPU caches)" + DEFAULT,
    )
    vllm.add_argument(
        "--drafts",
        type=int_in(0, 16),
        default=0,
        help="speculative decoding: draft tokens per decode (ngram in the synchronous "
        "order, ngram_gpu in the asynchronous one; the model accepts the first)" + DEFAULT,
    )
    vllm.add_argument(
        "--rounds", type=int_in(1, 1000), default=3, help="interleaved rounds" + DEFAULT
    )
    vllm.add_argument("--json", action="store_true")
    bench.set_defaults(func=cmd_bench)
