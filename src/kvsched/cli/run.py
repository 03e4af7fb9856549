"""``kvsched demo`` and ``kvsched replay``: run a workload or a trace through the scheduler."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvsched.cli.checks import (
    check_config_options,
    check_output,
    check_replay_options,
    check_report,
    check_run_options,
    fail,
)
from kvsched.cli.cluster import (
    add_cluster_options,
    check_cluster_options,
    cmd_cluster,
    engine_counts,
)
from kvsched.cli.options import COUNT, DEFAULT, OVERWRITE, add_publish, int_in, positive_float
from kvsched.cli.output import ReportError, finish, progress_bars, run_report, write_report_or_fail
from kvsched.config import (
    BLOCK_SIZE,
    CHECKPOINT_POLICIES,
    DEMO_MAX_BATCH,
    DEMO_NUM_BLOCKS,
    EVICTIONS,
    LONG_ORDERS,
    MAX_BATCH,
    MAX_BATCH_ROWS,
    MAX_BLOCKS,
    MAX_PREFILL_TOKENS,
    PLACEMENTS,
    PREFILL_TURNS,
    SchedulerConfig,
)
from kvsched.replay.demo import run_demo
from kvsched.replay.report import format_sweep, write_sweep
from kvsched.replay.runs import replay_trace, sweep_runs
from kvsched.replay.setup import (
    SWEEP_KEYS,
    SetupError,
    TraceReplay,
    checkpoint_fields,
    load_trace_replay,
    trace_config,
)
from kvsched.replay.sharing import SHARING_MODELS
from kvsched.replay.sweep_table import point_label
from kvsched.replay.traces import FORMATS, detect_format


def _check_demo(args: argparse.Namespace) -> None:
    """Everything ``demo`` checks before its first step."""
    check_run_options(args)
    check_output("--log", args.log, args.overwrite)
    check_report(args.report, args.overwrite)


def cmd_demo(args: argparse.Namespace) -> int:
    _check_demo(args)
    demo = run_demo(
        sessions=args.sessions,
        turns=args.turns,
        seed=args.seed,
        cache_blocks=args.cache_blocks,
        max_batch=args.max_batch,
        executor=args.executor,
        model=args.model,
        hybrid=args.hybrid,
        external=args.external,
        pipelined=args.pipelined,
        check=args.check,
        log=args.log,
        publish=args.publish,
        wait_subscribers=args.wait_subscribers,
        progress=progress_bars(args.quiet),
    )
    n = len(demo.workload.turns)
    title = f"kvsched demo: {n} chat turns"
    if args.external:
        title = f"kvsched demo --external: {n} chat turns, second engine"
    return finish(args, title, demo.result, demo.metrics)


# ---------------------------------------------------------------------- replay


def _check_replay(args: argparse.Namespace) -> None:
    """Everything ``replay`` checks before reading the trace (the config's own checks follow
    it: a kvsched log's header may make the run hybrid or TTFT-ordered)."""
    check_replay_options(args)
    if detect_format(args.trace, args.format) != "log":
        check_config_options(
            args, args.hybrid, args.order or "fcfs", args.prefill_turns or "interleave"
        )
    check_output("--log", args.log, args.overwrite, inputs=[args.trace])
    check_report(args.report, args.overwrite)


def cmd_replay(args: argparse.Namespace) -> int:
    counts = engine_counts(args)  # (a cluster's --sweep engines=... is taken out of --sweep)
    _check_replay(args)
    if counts is not None:
        check_cluster_options(args, counts)
    setup = load_trace_replay(
        args.trace,
        fmt=args.format,
        cost=args.cost,
        sweep=args.sweep,
        log=args.log,
        executor=args.executor,
        model=args.model,
        block_size=args.block_size,
        skip_bad_lines=args.skip_bad_lines,
        limit=args.limit,
        speedup=args.speedup,
        policies=args.policies,
        seed=args.seed,
        sharing=args.sharing,
        shape_params=args.shape_param,
    )
    info = setup.trace.info
    if info.bad_lines and not args.json:
        print(
            f"kvsched: skipped {len(info.bad_lines)} bad line(s) of {info.lines}: "
            + "; ".join(f"line {b.line}: {b.reason}" for b in info.bad_lines[:3]),
            file=sys.stderr,
        )
    config = trace_config(
        setup.trace,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        max_batch=args.max_batch,
        max_prefill_tokens=args.max_prefill_tokens,
        order=args.order,
        hybrid=args.hybrid,
        turns={
            "prefill_turns": args.prefill_turns,
            "short_turns_per_long": args.short_turns,
            "long_order": args.long_order,
        },
        checkpoints=checkpoint_fields(
            budget=args.checkpoint_budget,
            memory=args.checkpoint_memory,
            policy=args.checkpoint_policy,
            placement=args.checkpoint_placement,
            eviction=args.checkpoint_eviction,
            interval=args.checkpoint_interval,
        ),
    )
    check_config_options(args, config.hybrid, config.order, config.turns.policy)
    name = Path(args.trace).name
    if counts is not None:
        return cmd_cluster(args, setup, config, name, counts)
    if args.jobs > 1 and setup.sweep is None and not setup.policies:
        raise SetupError("--jobs runs sweep points in parallel: give --sweep or --policies")
    if setup.sweep is not None or setup.policies:
        if args.publish:
            raise SetupError("--publish streams one run: it cannot be combined with --sweep")
        return _replay_sweep(args, setup, config, name)
    result = replay_trace(
        setup,
        config,
        log=args.log,
        publish=args.publish,
        wait_subscribers=args.wait_subscribers,
        check=args.check,
        progress=progress_bars(args.quiet),
    )
    return finish(args, f"kvsched replay: {name}", result, {**result.metrics, **setup.extra()})


def _replay_sweep(
    args: argparse.Namespace, setup: TraceReplay, config: SchedulerConfig, name: str
) -> int:
    key = "+".join(k for k, _ in setup.sweeps)
    values = [v for _, vs in setup.sweeps for v in vs] or [0]
    runs: list[dict[str, Any]] = []
    progress = progress_bars(args.quiet or args.jobs > 1)
    failed = None  # the report's error: the runs go on, their table is printed, then exit 2
    for run in sweep_runs(
        setup, config, setup.sweeps, check=args.check, progress=progress, jobs=args.jobs
    ):
        runs.append(run.metrics)
        here = run.metrics["sweep_key"]
        if args.jobs > 1 and not args.quiet:
            print(
                f"kvsched: [{len(runs)}] {run.policy or 'run'} {here}="
                f"{point_label(here, run.value)}: "
                f"{100 * run.metrics['token_hit_rate']:.1f} % hit",
                file=sys.stderr,
                flush=True,
            )
        if args.report and failed is None:
            point = "_".join(filter(None, (run.policy, f"{here}={run.value}" if here else "")))
            where = Path(args.report) / point
            try:
                run_report(args.report, where, f"{name}, {point}", run.result, run.metrics)
            except ReportError as exc:
                failed = str(exc)
    if args.report and failed is None:
        try:
            write_report_or_fail(args.report, write_sweep, args.report, key, values, runs, name)
        except ReportError as exc:
            failed = str(exc)
    if args.json:
        print(json.dumps({"sweep_key": key, "values": values, "runs": runs}))
    else:
        parts = (f"sweep of {key}" if key else "", "policies" if setup.policies else "")
        what = " and ".join(filter(None, parts))
        print(f"kvsched replay: {name}, {what}")
        print(format_sweep(key, runs))
        if args.report and failed is None:
            print(f"  report: {args.report}")
    return fail(failed) if failed else 0


def add_replay(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    r = sub.add_parser(
        "replay",
        help="replay a request trace (Mooncake JSONL, Azure CSV, kvsched event log)",
        description="Replay a request trace through the scheduler and report TTFT, TPOT, "
        "prefix hit rates, preemptions and evictions.",
    )
    r.add_argument(
        "trace", metavar="TRACE", help="a trace file, or gen:chat-branching (a generated shape)"
    )
    r.add_argument("--format", choices=FORMATS, help="default: from the suffix")
    r.add_argument(
        "--executor", choices=["sim", "torch"], default="sim", help="sim: cost model" + DEFAULT
    )
    r.add_argument("--model", metavar="DIR", help="checkpoint directory (--executor torch)")
    r.add_argument(
        "--cache-blocks",
        type=int_in(2, MAX_BLOCKS),
        metavar="N",
        help="KV blocks (default: unbounded, never evicts)",
    )
    r.add_argument(
        "--block-size",
        type=int_in(1, 1 << 16),
        metavar="B",
        help=f"tokens per block (default {BLOCK_SIZE})",
    )
    r.add_argument(
        "--max-batch",
        type=int_in(1, MAX_BATCH),
        metavar="N",
        help=f"running sequences (default {MAX_BATCH_ROWS})",
    )
    r.add_argument(
        "--max-prefill-tokens",
        type=int_in(1, 1 << 24),
        metavar="N",
        help=f"default {MAX_PREFILL_TOKENS}",
    )
    r.add_argument("--order", choices=["fcfs", "priority", "ttft"], help="default fcfs")
    r.add_argument(
        "--prefill-turns",
        choices=list(PREFILL_TURNS),
        help="--order ttft: the prefill-turn policy (default interleave: lmdeploy's short-only "
        "turns while long prompts wait, a long chunk every --short-turns)",
    )
    r.add_argument(
        "--short-turns",
        type=int_in(1, 1 << 20),
        metavar="N",
        help="--prefill-turns interleave: short turns per long chunk (3)",
    )
    r.add_argument(
        "--long-order",
        choices=list(LONG_ORDERS),
        help="--order ttft: long prompts by chunks left with aging (size, default) or by arrival",
    )
    r.add_argument("--hybrid", action="store_true", help="hybrid model (state checkpoints)")
    r.add_argument("--cost", metavar="K=V,...", help="cost-model parameters (see docs/replay.md)")
    r.add_argument(
        "--sweep",
        action="append",
        metavar="KEY=V1,V2",
        help=f"keys: {', '.join(SWEEP_KEYS)}; checkpoint-budget takes 'unbounded'; give it "
        "again for another key (e.g. checkpoint budgets beside checkpoint memories)",
    )
    r.add_argument(
        "--jobs",
        type=int_in(1, 256),
        default=1,
        metavar="N",
        help="run sweep points in N processes (progress: one line per point)" + DEFAULT,
    )
    r.add_argument(
        "--checkpoint-budget",
        type=int_in(0, 1 << 20),
        metavar="N",
        help="--hybrid: checkpoint slots (256)",
    )
    r.add_argument(
        "--checkpoint-memory",
        metavar="BYTES",
        help="--hybrid: bytes for checkpoints instead of a count, e.g. 20GiB",
    )
    r.add_argument(
        "--checkpoint-policy",
        choices=list(CHECKPOINT_POLICIES),
        help="--hybrid: placement and eviction rules (default kvsched; baselines: "
        "lmdeploy, vllm-align, sglang; vllm-kvsched: kvsched inside vLLM; oracle: an upper "
        "reference that knows the trace's future)",
    )
    r.add_argument(
        "--checkpoint-placement",
        metavar="RULES",
        help=f"--hybrid: comma-separated placement rules of {', '.join(PLACEMENTS)}",
    )
    r.add_argument("--checkpoint-eviction", choices=list(EVICTIONS), help="--hybrid")
    r.add_argument(
        "--checkpoint-interval",
        type=int_in(1, 1 << 31),
        metavar="N",
        help="tokens between interval saves",
    )
    r.add_argument(
        "--policies",
        metavar="P1,P2|all",
        help="run every sweep point once per checkpoint policy, side by side",
    )
    add_cluster_options(r)
    r.add_argument("--limit", type=COUNT, metavar="N", help="read only the first N requests")
    r.add_argument(
        "--speedup",
        type=positive_float,
        default=1.0,
        metavar="F",
        help="divide arrival times by F (what-if: F times the load)" + DEFAULT,
    )
    r.add_argument(
        "--seed",
        type=int_in(0, (1 << 63) - 1),
        default=0,
        help="seed of synthesised tokens and of gen:NAME shapes" + DEFAULT,
    )
    r.add_argument(
        "--sharing",
        choices=list(SHARING_MODELS),
        help="Azure traces: the prefix-sharing model (default none: nothing shared; "
        "code-edit: users editing files in repositories, docs/replay.md)",
    )
    r.add_argument(
        "--shape-param",
        metavar="K=V,...",
        help="parameters of gen:NAME or of --sharing (docs/replay.md)",
    )
    r.add_argument("--skip-bad-lines", action="store_true", help="count bad lines, skip them")
    r.add_argument("--log", metavar="OUT", help="record the run to this event log")
    add_publish(r)
    r.add_argument("--report", metavar="DIR", help="write metrics JSON and PNG plots here")
    r.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    r.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    r.add_argument("--check", action="store_true", help="check invariants after every step")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_replay)


def add_demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    demo = sub.add_parser("demo", help="run the built-in multi-turn chat workload (simulated)")
    demo.add_argument("--log", help="record the run to this event log")
    add_publish(demo)
    demo.add_argument(
        "--sessions", type=int_in(1, 1 << 20), default=64, help="chat sessions" + DEFAULT
    )
    demo.add_argument(
        "--turns", type=int_in(1, 1 << 12), default=4, help="turns per session" + DEFAULT
    )
    demo.add_argument(
        "--seed", type=int_in(0, (1 << 63) - 1), default=0, help="workload seed" + DEFAULT
    )
    demo.add_argument(
        "--cache-blocks",
        type=int_in(2, MAX_BLOCKS),
        default=DEMO_NUM_BLOCKS,
        help="KV blocks" + DEFAULT,
    )
    demo.add_argument(
        "--max-batch",
        type=int_in(1, MAX_BATCH),
        default=DEMO_MAX_BATCH,
        help="running sequences" + DEFAULT,
    )
    demo.add_argument("--check", action="store_true", help="check invariants after every step")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument("--report", metavar="DIR", help="write metrics JSON and PNG plots here")
    demo.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--executor",
        choices=["sim", "torch"],
        default="sim",
        help="sim: cost model; torch: a real forward pass (CPU or CUDA)" + DEFAULT,
    )
    demo.add_argument(
        "--model", metavar="DIR", help="checkpoint for --executor torch (default: a tiny model)"
    )
    demo.add_argument("--hybrid", action="store_true", help="schedule a hybrid model's states")
    demo.add_argument(
        "--external",
        action="store_true",
        help="serve the workload twice through one in-process KV store: the second engine"
        " (empty cache) loads the first one's saved prefixes; the second run is reported",
    )
    demo.add_argument(
        "--pipelined",
        action="store_true",
        help="overlapped steps (vLLM's async scheduling): each step is planned while the one"
        " before runs, and its outcome is folded a step later",
    )
    demo.set_defaults(func=cmd_demo)
