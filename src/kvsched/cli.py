"""The ``kvsched`` command: demo, verify, bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from tqdm import tqdm

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine, create_log
from kvsched.events.log import CorruptLogError, LogOpenError
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.driver import RunSummary, run
from kvsched.replay.verify import verify_log
from kvsched.replay.workload import chat_workload


def _fail(message: str, code: int = 2) -> int:
    print(f"kvsched: error: {message}", file=sys.stderr)
    return code


def _print_summary(title: str, s: RunSummary) -> None:
    print(f"{title}")
    rows = [
        ("requests", f"{s.requests} ({s.finished} finished, {s.rejected} rejected)"),
        ("prompt tokens", f"{s.prompt_tokens:,}"),
        ("generated tokens", f"{s.generated_tokens:,}"),
        ("prefill tokens computed", f"{s.prefill_tokens:,}"),
        ("prefix hit rate", f"{100 * s.hit_rate:.1f} % of prompt tokens"),
        ("preemptions", f"{s.preemptions}"),
        ("steps", f"{s.steps:,}"),
        ("simulated time", f"{s.sim_time_s:.2f} s"),
        ("throughput (simulated)", f"{s.generated_tokens / max(s.sim_time_s, 1e-9):,.0f} tok/s"),
        ("wall time", f"{s.wall_time_s:.2f} s ({s.steps / max(s.wall_time_s, 1e-9):,.0f} steps/s)"),
    ]
    for name, value in rows:
        print(f"  {name:<26}{value}")


def cmd_demo(args: argparse.Namespace) -> int:
    config = SchedulerConfig(num_blocks=args.cache_blocks, max_batch=args.max_batch)
    log = None
    if args.log:
        try:
            log = create_log(args.log, config)
        except LogOpenError as exc:
            return _fail(str(exc))
    workload = chat_workload(sessions=args.sessions, turns=args.turns, seed=args.seed)
    engine = Engine(config, log=log, check_invariants=args.check)
    bar = tqdm(total=len(workload.turns), desc="demo", unit="req", disable=args.quiet)

    def progress(result: object) -> None:
        done = engine.state.stats.requests_finished + engine.state.stats.requests_rejected
        bar.update(done - bar.n)

    summary = run(engine, SimulatedExecutor(config.model.vocab_size), workload, on_step=progress)
    bar.close()
    if log is not None:
        log.close()
    if args.json:
        print(json.dumps(summary.as_dict()))
    else:
        _print_summary(f"kvsched demo: {len(workload.turns)} chat turns", summary)
        if args.log:
            print(f"  {'event log':<26}{args.log}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    try:
        bar = tqdm(desc="verify", unit="step", disable=args.quiet)
        result = verify_log(args.log, on_step=lambda n: bar.update(1))
        bar.close()
    except CorruptLogError as exc:
        return _fail(str(exc), 1)
    except OSError as exc:
        return _fail(f"cannot read {args.log}: {exc.strerror or exc}")
    if result.torn_tail is not None:
        t = result.torn_tail
        print(
            f"torn tail at byte {t.offset} ({t.reason}); "
            f"verified the {result.steps} complete steps before it"
        )
    if result.divergence is not None:
        print(result.divergence.describe())
        print("1 divergence")
        return 1
    print(f"{result.steps} steps verified, 0 divergences")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "match":
        from kvsched.bench.match import run_match_bench

        try:
            out = run_match_bench(
                mode=args.mode,
                batch=args.batch,
                context=args.context,
                block_size=args.block_size,
                warmup=args.warmup,
                samples=args.samples,
            )
        except ValueError as exc:
            return _fail(str(exc))
    else:
        from kvsched.bench.step import run_step_bench

        out = run_step_bench(running=args.running, warmup=args.warmup, samples=args.samples)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"  {key:<12}{value}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks (prefix match, scheduler step)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    match = kinds.add_parser("match", help="prefix match on lmdeploy's aligned exact-hit workload")
    match.add_argument("--mode", choices=["ar", "ssm"], default="ar")
    match.add_argument("--batch", type=int, default=128)
    match.add_argument("--context", type=int, default=65536)
    match.add_argument("--block-size", type=int, default=64)
    match.add_argument("--warmup", type=int, default=2)
    match.add_argument("--samples", type=int, default=10)
    match.add_argument("--json", action="store_true")
    step = kinds.add_parser("step", help="one scheduler step with N running decode sequences")
    step.add_argument("--running", type=int, default=1024)
    step.add_argument("--warmup", type=int, default=5)
    step.add_argument("--samples", type=int, default=200)
    step.add_argument("--json", action="store_true")
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in multi-turn chat workload (simulated)")
    demo.add_argument("--log", help="record the run to this event log")
    demo.add_argument("--sessions", type=int, default=64)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--cache-blocks", type=int, default=2048)
    demo.add_argument("--max-batch", type=int, default=64)
    demo.add_argument("--check", action="store_true", help="check invariants after every step")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(func=cmd_demo)
    verify = sub.add_parser("verify", help="re-run an event log and compare every decision")
    verify.add_argument("log")
    verify.add_argument("--quiet", action="store_true")
    verify.set_defaults(func=cmd_verify)
    _add_bench(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
