"""The ``kvsched`` command: demo, replay, diff, verify, bench."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.connectors import InProcessStore, StoreConnector, TransferEngine
from kvsched.connectors.buffers import HostBlockBuffer, HostStateBuffer
from kvsched.engine import Engine, create_log
from kvsched.events.log import CorruptLogError, EventLog, LogOpenError
from kvsched.gpu.sim import CostModel, SimulatedExecutor
from kvsched.replay.diff import diff_logs, format_diff
from kvsched.replay.driver import Executor, run
from kvsched.replay.external import ExternalKV
from kvsched.replay.metrics import ReplayResult, replay_workload
from kvsched.replay.report import format_sweep, format_table, write_report, write_sweep
from kvsched.replay.traces import (
    FORMATS,
    Trace,
    TraceError,
    TraceInfo,
    detect_format,
    log_config,
    read_trace,
)
from kvsched.replay.verify import verify_log
from kvsched.replay.workload import Workload, chat_workload, speed_up


def _fail(message: str, code: int = 2) -> int:
    print(f"kvsched: error: {message}", file=sys.stderr)
    return code


def _progress_bar(total: int, desc: str, quiet: bool) -> tuple[Callable[[int], None], Any]:
    bar = tqdm(total=total, desc=desc, unit="req", disable=quiet, leave=False)

    def progress(done: int) -> None:
        if done != bar.n:
            bar.update(done - bar.n)

    return progress, bar


def _replay(
    engine: Engine,
    executor: Executor,
    workload: Workload,
    *,
    desc: str,
    quiet: bool,
    external: ExternalKV | None = None,
) -> ReplayResult:
    """The one replay path of ``demo`` and ``replay``: driver + metrics recorder + progress."""
    progress, bar = _progress_bar(len(workload.turns), desc, quiet)
    driver = functools.partial(run, external=external) if external is not None else run
    try:
        return replay_workload(engine, executor, workload, progress=progress, driver=driver)
    finally:
        bar.close()


def _external(store: InProcessStore, config: SchedulerConfig, executor: Executor) -> ExternalKV:
    """The bridge to ``store``: the torch executor's cache as buffers, host buffers for the
    simulated executor (whose KV has no contents)."""
    blocks: Any
    states: Any
    if isinstance(executor, SimulatedExecutor):
        blocks = HostBlockBuffer(config.num_blocks, 64)
        states = HostStateBuffer(config.num_state_slots, 8, 8)
    else:
        from kvsched.gpu.transfer_buffer import TorchCacheBuffer

        blocks = states = TorchCacheBuffer(executor)  # type: ignore[arg-type]
    worker = TransferEngine(store, blocks, states if config.hybrid else None)
    return ExternalKV(StoreConnector(store, synchronous=True), worker)


def _open_log(path: str | None, config: SchedulerConfig) -> EventLog | None:
    return create_log(path, config) if path else None


def _finish(
    args: argparse.Namespace, title: str, result: ReplayResult, extra: dict[str, Any]
) -> int:
    metrics = {**result.metrics, **extra}
    if args.report:
        try:
            ttft = result.recorder.latencies()[0]
            write_report(args.report, metrics, result.series, ttft, title)
        except (OSError, RuntimeError) as exc:
            return _fail(f"cannot write the report to {args.report}: {exc}")
    if args.json:
        print(json.dumps(metrics))
    else:
        print(format_table(title, metrics))
        if args.log:
            print(f"  {'event log':<26}{args.log}")
        if args.report:
            print(f"  {'report':<26}{args.report}")
    return 0


def _demo_model(args: argparse.Namespace, workdir: str) -> tuple[str, int]:
    """The checkpoint for ``demo --executor torch``: --model DIR, else a seeded tiny
    Qwen3.5-style model written to ``workdir``. Returns (directory, vocabulary size)."""
    if args.model:
        config_path = os.path.join(args.model, "config.json")
        try:
            with open(config_path) as f:
                return args.model, int(json.load(f)["vocab_size"])
        except (OSError, KeyError, ValueError) as exc:
            raise UsageError(f"--model {args.model}: cannot read {config_path}: {exc}") from None
    try:
        from kvsched.gpu.fixtures import build_tiny_model
    except ImportError as exc:
        raise UsageError(f"--executor torch needs the torch extra: {exc}") from None
    path, model_config = build_tiny_model(os.path.join(workdir, "tiny-qwen3.5"), seed=args.seed)
    return str(path), int(model_config.vocab_size)


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        with tempfile.TemporaryDirectory(prefix="kvsched-demo-") as workdir:
            return _demo(args, workdir)
    except UsageError as exc:
        return _fail(str(exc))


def _demo(args: argparse.Namespace, workdir: str) -> int:
    vocab, model_dir = ModelSpec().vocab_size, None
    if args.executor == "torch":
        _torch_module()  # fail before any work when torch is missing
        model_dir, vocab = _demo_model(args, workdir)
    config = SchedulerConfig(
        model=ModelSpec(vocab_size=vocab),
        num_blocks=args.cache_blocks,
        max_batch=args.max_batch,
        hybrid=args.hybrid or args.executor == "torch",  # the torch model is hybrid
        external_kv=args.external,
    )
    try:
        log = _open_log(args.log, config)
    except LogOpenError as exc:
        return _fail(str(exc))
    workload = chat_workload(
        sessions=args.sessions, turns=args.turns, seed=args.seed, vocab_size=vocab
    )
    if args.external:
        return _demo_external(args, config, workload, model_dir, log)
    engine = Engine(config, log=log, check_invariants=args.check)
    executor = make_executor(args.executor, config, CostModel(), model_dir)
    try:
        result = _replay(engine, executor, workload, desc="demo", quiet=args.quiet)
    finally:
        if log is not None:
            log.close()
    title = f"kvsched demo: {len(workload.turns)} chat turns"
    return _finish(args, title, result, {"workload": workload.name})


def _demo_external(
    args: argparse.Namespace,
    config: SchedulerConfig,
    workload: Workload,
    model_dir: str | None,
    log: EventLog | None,
) -> int:
    """Serve the workload on engine A, saving to an in-process store; then on engine B (a
    restarted server: empty cache, same store), which loads A's prefixes. B's run is the one
    logged and reported."""
    store = InProcessStore(capacity_bytes=8 << 30)

    def serve(engine: Engine, desc: str) -> ReplayResult:
        executor = make_executor(args.executor, config, CostModel(), model_dir)
        external = _external(store, config, executor)
        return _replay(engine, executor, workload, desc=desc, quiet=args.quiet, external=external)

    res_a = serve(Engine(config, check_invariants=args.check), "demo A")
    engine = Engine(config, log=log, check_invariants=args.check)
    try:
        result = serve(engine, "demo B")
    finally:
        if log is not None:
            log.close()
    title = f"kvsched demo --external: {len(workload.turns)} chat turns, second engine"
    extra = {
        "workload": workload.name,
        "external_hit_tokens": engine.state.stats.external_hit_tokens,
        "engine_a_prefill_tokens": res_a.metrics.get("prefill_tokens", 0),
        "store_values": len(store),
    }
    return _finish(args, title, result, extra)


# ---------------------------------------------------------------------- replay

TRACE_VOCAB = 150_000
SWEEP_KEYS = {
    "cache-blocks": "num_blocks",
    "block-size": "block_size",
    "max-batch": "max_batch",
    "max-prefill-tokens": "max_prefill_tokens",
}


class UsageError(Exception):
    """A command-line problem found after parsing: exit 2 with this message."""


def _parse_sweep(spec: str) -> tuple[str, list[int]]:
    key, sep, raw = spec.partition("=")
    key = key.strip()
    if not sep or key not in SWEEP_KEYS:
        raise UsageError(
            f"--sweep {spec!r}: expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}"
        )
    try:
        values = [int(v.replace("_", "")) for v in raw.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--sweep {spec!r}: values must be integers") from None
    if not values or min(values) <= 0:
        raise UsageError(f"--sweep {spec!r}: give one or more positive values")
    return key, values


def _torch_module() -> Any:
    try:
        return importlib.import_module("kvsched.gpu.torch_executor")
    except ImportError as exc:
        raise UsageError(
            f"--executor torch: the torch executor is not available ({exc}); "
            "install it with pip install 'kvsched[torch]' or use --executor sim"
        ) from None


def make_executor(
    kind: str, config: SchedulerConfig, cost: CostModel, model: str | None = None
) -> Executor:
    if kind == "sim":
        return SimulatedExecutor(config.model.vocab_size, cost)
    factory = getattr(_torch_module(), "TorchExecutor", None)
    if factory is None:
        raise UsageError("--executor torch: kvsched.gpu.torch_executor has no TorchExecutor")
    if model is None:
        raise UsageError("--executor torch needs --model DIR (a checkpoint directory)")
    try:
        executor: Executor = factory(
            model, config.num_blocks, config.block_size, config.num_state_slots
        )
    except Exception as exc:  # a missing GPU, driver or weights: say so, exit 2
        raise UsageError(f"--executor torch: cannot start the torch executor: {exc}") from None
    return executor


def unbounded_blocks(info: TraceInfo, requests: int, block_size: int) -> int:
    """Enough blocks that nothing is ever evicted: every request's prompt and output in
    blocks of its own (an upper bound on the distinct blocks of the whole trace)."""
    return info.total_tokens // block_size + 2 * requests + 2


def _trace_config(args: argparse.Namespace, trace: Trace) -> SchedulerConfig:
    base: dict[str, Any] = {}
    if trace.info.format == "log":
        base = log_config(args.trace)
    model = dict(base.get("model", {}))
    if trace.info.format != "log":
        model["vocab_size"] = TRACE_VOCAB
    longest = trace.info.max_request_tokens + 1
    context = int(model.get("max_context", ModelSpec().max_context))
    while context < longest:
        context *= 2
    model["max_context"] = context
    block_size = args.block_size or int(base.get("block_size", 64))
    if args.cache_blocks is not None:
        num_blocks = args.cache_blocks
    else:
        num_blocks = unbounded_blocks(trace.info, trace.info.requests, block_size)
    fields = {
        **{k: v for k, v in base.items() if k != "model"},
        "model": ModelSpec(**model),
        "block_size": block_size,
        "num_blocks": num_blocks,
    }
    if args.max_batch is not None:
        fields["max_batch"] = args.max_batch
    if args.max_prefill_tokens is not None:
        fields["max_prefill_tokens"] = args.max_prefill_tokens
    if args.order is not None:
        fields["order"] = args.order
    if args.hybrid:
        fields["hybrid"] = True
    try:
        return SchedulerConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad configuration: {exc}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        return _cmd_replay(args)
    except (UsageError, TraceError) as exc:
        return _fail(str(exc))
    except LogOpenError as exc:
        return _fail(str(exc))


def _cmd_replay(args: argparse.Namespace) -> int:
    kind = detect_format(args.trace, args.format)
    try:
        cost = CostModel.parse(args.cost or "")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sweep = _parse_sweep(args.sweep) if args.sweep else None
    if sweep and args.log:
        raise UsageError("--log records one run: it cannot be combined with --sweep")
    if args.executor == "torch":
        _torch_module()  # fail before reading the trace
        if args.model is None:
            raise UsageError("--executor torch needs --model DIR (a checkpoint directory)")
    trace = read_trace(
        args.trace,
        kind,
        block_size=args.block_size or 64,
        vocab_size=TRACE_VOCAB,
        skip_bad_lines=args.skip_bad_lines,
        limit=args.limit,
    )
    if args.speedup != 1.0:
        if not args.speedup > 0:
            raise UsageError(f"--speedup must be positive, got {args.speedup}")
        trace = attrs.evolve(trace, workload=speed_up(trace.workload, args.speedup))
    info = trace.info
    if info.bad_lines and not args.json:
        print(
            f"kvsched: skipped {len(info.bad_lines)} bad line(s) of {info.lines}: "
            + "; ".join(f"line {b.line}: {b.reason}" for b in info.bad_lines[:3]),
            file=sys.stderr,
        )
    config = _trace_config(args, trace)
    extra: dict[str, Any] = {
        "trace": info.path,
        "format": info.format,
        "trace_lines": info.lines,
        "bad_lines": len(info.bad_lines),
        "out_of_order": info.out_of_order,
        "ideal_hit_rate": info.ideal_hit_rate,
        "executor": args.executor,
        "speedup": args.speedup,
        "cost_model": cost.to_dict(),
    }
    name = Path(args.trace).name
    if sweep is None:
        return _replay_once(args, trace, config, cost, extra, f"kvsched replay: {name}")
    return _replay_sweep(args, trace, config, cost, extra, sweep, name)


def _replay_once(
    args: argparse.Namespace,
    trace: Trace,
    config: SchedulerConfig,
    cost: CostModel,
    extra: dict[str, Any],
    title: str,
) -> int:
    executor = make_executor(args.executor, config, cost, args.model)
    log = _open_log(args.log, config)
    engine = Engine(config, log=log, check_invariants=args.check)
    try:
        result = _replay(engine, executor, trace.workload, desc="replay", quiet=args.quiet)
    finally:
        if log is not None:
            log.close()
    return _finish(args, title, result, extra)


def _replay_sweep(
    args: argparse.Namespace,
    trace: Trace,
    config: SchedulerConfig,
    cost: CostModel,
    extra: dict[str, Any],
    sweep: tuple[str, list[int]],
    name: str,
) -> int:
    key, values = sweep
    runs: list[dict[str, Any]] = []
    for value in values:
        try:
            cfg = SchedulerConfig.from_dict({**config.to_dict(), SWEEP_KEYS[key]: value})
        except ValueError as exc:
            raise UsageError(f"--sweep {key}={value}: {exc}") from None
        executor = make_executor(args.executor, cfg, cost, args.model)
        engine = Engine(cfg, check_invariants=args.check)
        result = _replay(engine, executor, trace.workload, desc=f"{key}={value}", quiet=args.quiet)
        metrics = {**result.metrics, **extra, "sweep_key": key, "sweep_value": value}
        runs.append(metrics)
        if args.report:
            try:
                write_report(
                    Path(args.report) / f"{key}={value}",
                    metrics,
                    result.series,
                    result.recorder.latencies()[0],
                    f"{name}, {key}={value}",
                )
            except (OSError, RuntimeError) as exc:
                return _fail(f"cannot write the report to {args.report}: {exc}")
    if args.report:
        try:
            write_sweep(args.report, key, values, runs, name)
        except (OSError, RuntimeError) as exc:
            return _fail(f"cannot write the report to {args.report}: {exc}")
    if args.json:
        print(json.dumps({"sweep_key": key, "values": values, "runs": runs}))
    else:
        print(f"kvsched replay: {name}, sweep of {key}")
        print(format_sweep(key, values, runs))
        if args.report:
            print(f"  report: {args.report}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    try:
        result = diff_logs(args.log_a, args.log_b)
    except CorruptLogError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot read {exc.filename or 'log'}: {exc.strerror or exc}")
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(format_diff(result, args.log_a, args.log_b))
    return 0 if result.identical else 1


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


def _add_replay(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    r = sub.add_parser(
        "replay",
        help="replay a request trace (Mooncake JSONL, Azure CSV, kvsched event log)",
        description="Replay a request trace through the scheduler and report TTFT, TPOT, "
        "prefix hit rates, preemptions and evictions.",
    )
    r.add_argument("trace", metavar="TRACE")
    r.add_argument("--format", choices=FORMATS, help="default: from the suffix")
    r.add_argument("--executor", choices=["sim", "torch"], default="sim")
    r.add_argument("--model", metavar="DIR", help="checkpoint directory (--executor torch)")
    r.add_argument(
        "--cache-blocks", type=int, metavar="N", help="KV blocks (default: unbounded, never evicts)"
    )
    r.add_argument("--block-size", type=int, metavar="B", help="tokens per block (default 64)")
    r.add_argument("--max-batch", type=int, metavar="N", help="running sequences (default 256)")
    r.add_argument("--max-prefill-tokens", type=int, metavar="N", help="default 8192")
    r.add_argument("--order", choices=["fcfs", "priority", "ttft"], help="default fcfs")
    r.add_argument("--hybrid", action="store_true", help="hybrid model (state checkpoints)")
    r.add_argument("--cost", metavar="K=V,...", help="cost-model parameters (see docs/replay.md)")
    r.add_argument("--sweep", metavar="KEY=V1,V2", help=f"keys: {', '.join(SWEEP_KEYS)}")
    r.add_argument("--limit", type=int, metavar="N", help="read only the first N requests")
    r.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        metavar="F",
        help="divide arrival times by F (what-if: F times the load)",
    )
    r.add_argument("--skip-bad-lines", action="store_true", help="count bad lines, skip them")
    r.add_argument("--log", metavar="OUT", help="record the run to this event log")
    r.add_argument("--report", metavar="DIR", help="write metrics JSON and PNG plots here")
    r.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    r.add_argument("--check", action="store_true", help="check invariants after every step")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_replay)


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
    demo.add_argument("--report", metavar="DIR", help="write metrics JSON and PNG plots here")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--executor",
        choices=["sim", "torch"],
        default="sim",
        help="sim: cost model; torch: a real forward pass (CPU or CUDA)",
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
    demo.set_defaults(func=cmd_demo)
    _add_replay(sub)
    diff = sub.add_parser("diff", help="where two event logs' decisions first differ")
    diff.add_argument("log_a", metavar="LOG_A")
    diff.add_argument("log_b", metavar="LOG_B")
    diff.add_argument("--json", action="store_true", help="print the comparison as JSON")
    diff.set_defaults(func=cmd_diff)
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
