"""``kvsched replay TRACE --engines N [--route R,...] [--sweep engines=N1,N2]``: the cluster
what-if (``replay/cluster.py``): the trace across N simulated engines behind a router, each
route and engine count one run, side by side."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvsched.cli.checks import check_output, fail
from kvsched.cli.options import int_in
from kvsched.cli.output import ReportError, progress_bars, write_report_or_fail
from kvsched.config import SchedulerConfig
from kvsched.engine import Engine
from kvsched.reducers.future import reads_future
from kvsched.replay.cluster import ROUTES, ClusterRun, run_cluster
from kvsched.replay.cluster_report import write_cluster
from kvsched.replay.report import write_sweep
from kvsched.replay.setup import SetupError, TraceReplay, make_executor, open_log

MAX_ENGINES = 1024


def add_cluster_options(r: argparse.ArgumentParser) -> None:
    r.add_argument(
        "--engines",
        type=int_in(1, MAX_ENGINES),
        metavar="N",
        help="replay across N simulated engines behind a router (--route); "
        "--sweep engines=N1,N2 compares engine counts",
    )
    r.add_argument(
        "--route",
        metavar="R[,R...]",
        help=f"with --engines: the router, several side by side ({', '.join(ROUTES)}; "
        "default kv_aware)",
    )


def engine_counts(args: argparse.Namespace) -> list[int] | None:
    """The engine counts of a cluster replay (``--engines N`` or ``--sweep engines=...``,
    which is taken out of ``args.sweep``), or None for a plain replay."""
    specs = [args.sweep] if isinstance(args.sweep, str) else list(args.sweep or ())
    mine = [s for s in specs if s.partition("=")[0].strip() == "engines"]
    args.sweep = [s for s in specs if s not in mine] or None
    if len(mine) > 1:
        raise SetupError("--sweep engines=...: give it once, listing the counts")
    if mine and args.engines is not None:
        raise SetupError("--engines and --sweep engines=...: the sweep sets it; drop one")
    if mine:
        return [_count(v) for v in mine[0].partition("=")[2].split(",")]
    if args.engines is not None:
        return [args.engines]
    if args.route is not None:
        raise SetupError("--route chooses an engine per request: give --engines N too")
    return None


def _count(text: str) -> int:
    try:
        n = int(text.strip().replace("_", ""))
    except ValueError:
        raise SetupError(f"--sweep engines: expected integers, got {text!r}") from None
    if not 1 <= n <= MAX_ENGINES:
        raise SetupError(f"--sweep engines: each count in [1, {MAX_ENGINES}], got {n}")
    return n


def routes(args: argparse.Namespace) -> list[str]:
    """The routes to compare (``--route``, default kv_aware), each checked."""
    names = [r.strip() for r in (args.route or "kv_aware").split(",")]
    for name in names:
        if name not in ROUTES:
            raise SetupError(f"--route {name!r}: expected one of {', '.join(ROUTES)}")
    if len(set(names)) != len(names):
        raise SetupError(f"--route: each route once (got {args.route})")
    return names


def check_cluster_options(args: argparse.Namespace, counts: list[int]) -> None:
    """Refuse, before the trace is read, what a cluster replay cannot do."""
    for given, why in (
        (args.sweep, "--sweep takes only engines=... with --engines"),
        (args.policies, "--policies compares checkpoint policies on one engine"),
        (args.publish, "--publish streams one engine's run"),
        (args.executor == "torch", "--executor torch: a cluster runs simulated executors"),
        (args.jobs > 1, "--jobs: a cluster's runs share one process"),
    ):
        if given:
            raise SetupError(f"{why}: drop it, or replay without --engines")
    runs = len(counts) * len(routes(args))
    if args.log and runs > 1:
        raise SetupError("--log records one cluster run: give one engine count and one route")
    for k in range(max(counts) if args.log else 0):
        check_output("--log", engine_log(args.log, k), args.overwrite, inputs=[args.trace])


def engine_log(path: str, k: int) -> str:
    """Engine ``k``'s event log beside ``path``: ``run.kvlog`` -> ``run.e0.kvlog``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.e{k}{p.suffix}"))


def cmd_cluster(
    args: argparse.Namespace,
    setup: TraceReplay,
    config: SchedulerConfig,
    name: str,
    counts: list[int],
) -> int:
    """Every (engine count, route) run, printed side by side; the report and JSON too."""
    if reads_future(config):
        raise SetupError(
            "--checkpoint-policy oracle reads the trace's future, which no engine of a "
            "cluster sees alone: compare online policies across engines"
        )
    runs: list[dict[str, Any]] = []
    progress = progress_bars(args.quiet)
    for n in counts:
        for route in routes(args):
            run = _run(args, setup, config, n, route, progress)
            runs.append(_metrics(run, setup, n))
    failed = None
    if args.report:
        title = f"{name}, a cluster"
        try:
            write_report_or_fail(
                args.report, write_sweep, args.report, "engines", counts, runs, title
            )
            write_report_or_fail(args.report, write_cluster, args.report, runs, title)
        except ReportError as exc:
            failed = str(exc)
    if args.json:
        print(json.dumps({"sweep_key": "engines", "values": counts, "runs": runs}))
    else:
        print(f"kvsched replay: {name}, a cluster of simulated engines behind a router")
        print(format_cluster(runs))
        if args.report and failed is None:
            print(f"  report: {args.report}")
    return fail(failed) if failed else 0


def _run(
    args: argparse.Namespace,
    setup: TraceReplay,
    config: SchedulerConfig,
    n: int,
    route: str,
    progress: Any,
) -> ClusterRun:
    logs = [open_log(engine_log(args.log, k) if args.log else None, config) for k in range(n)]
    try:
        engines = [Engine(config, log=log, check_invariants=args.check) for log in logs]
        executors = [make_executor("sim", config, setup.cost) for _ in range(n)]
        workload = setup.trace.workload
        with progress(f"{route} x{n}", len(workload.turns)) as update:
            return run_cluster(engines, executors, workload, route, progress=update)
    finally:
        for log in logs:
            if log is not None:
                log.close()


def _metrics(run: ClusterRun, setup: TraceReplay, n: int) -> dict[str, Any]:
    per = [r.metrics for r in run.engines]
    return {
        **run.metrics,
        **setup.extra(),
        "checkpoint_policy": run.route,  # (the sweep table's and plot's line)
        "sweep_key": "engines",
        "sweep_value": n,
        "kv_block_evictions": sum(m["kv_block_evictions"] for m in per),
        "checkpoint_evictions": sum(m["checkpoint_evictions"] for m in per),
    }


def format_cluster(runs: list[dict[str, Any]]) -> str:
    """One line per run: route, engines, hit rate, TTFT p50 / p99, and the spread of
    requests and of computed prefill tokens over engines (max / mean; 1.00 is even); for a
    single run, a line per engine below."""
    head = (
        f"  {'route':<15}{'engines':>8}  {'hit rate':>9}  {'TTFT p50':>10}  {'TTFT p99':>10}"
        f"  {'requests max/mean':>17}  {'prefill max/mean':>16}"
    )
    lines = [head]
    for m in runs:
        lines.append(
            f"  {m['route']:<15}{m['engines']:>8}  {_row(m)}"
            f"  {m['request_imbalance']:>17.2f}  {m['prefill_imbalance']:>16.2f}"
        )
    if len(runs) == 1:  # one run: its engines too
        for k, e in enumerate(runs[0]["per_engine"]):
            lines.append(f"    engine {k:<4}{e['requests']:>9,} req  {_row(e)}")
    return "\n".join(lines)


def _row(m: dict[str, Any]) -> str:
    return (
        f"{100 * m['token_hit_rate']:>7.1f} %  {1000 * m['ttft_p50_s']:>7,.0f} ms"
        f"  {1000 * m['ttft_p99_s']:>7,.0f} ms"
    )
