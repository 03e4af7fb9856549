"""The ``kvsched`` command: demo, replay, diff, verify, watch, bench."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import struct
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvsched.config import (
    CHECKPOINT_POLICIES,
    EVICTIONS,
    IDENTITY_SCHEMES,
    LONG_ORDERS,
    MAX_BATCH,
    MAX_BLOCKS,
    PLACEMENTS,
    PREFILL_TURNS,
    SchedulerConfig,
)
from kvsched.events.codec import RecordDecodeError, SchemaVersionError
from kvsched.events.framing import HEADER_OFFSET, PREFIX_SIZE
from kvsched.events.log import CorruptLogError, LogOpenError, LogWriteError
from kvsched.events.wire import WireError
from kvsched.replay.demo import run_demo
from kvsched.replay.diff import diff_logs, format_diff
from kvsched.replay.metrics import ReplayResult
from kvsched.replay.report import format_sweep, format_table, write_report, write_sweep
from kvsched.replay.runs import Progress, replay_trace, sweep_runs
from kvsched.replay.setup import (
    SWEEP_KEYS,
    SetupError,
    TraceReplay,
    checkpoint_fields,
    load_trace_replay,
    trace_config,
)
from kvsched.replay.traces import FORMATS, TraceError, detect_format
from kvsched.replay.verify import LogError, VerifyInterrupted, verify_log
from kvsched.stream.watch import StreamError, Watched, dump, summary_line, watch


def _fail(message: str, code: int = 2) -> int:
    print(f"kvsched: error: {message}", file=sys.stderr)
    return code


# ------------------------------------------------------------ files a command writes


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


def _check_output(
    option: str, path: str | None, overwrite: bool, inputs: Sequence[str] = ()
) -> None:
    """Refuse, before any work, to write ``path`` over one of the ``inputs`` (even with
    ``--overwrite``) or over an existing file without ``--overwrite``."""
    if not path:
        return
    for given in inputs:
        if _same_file(path, given):
            raise SetupError(f"{option} {path} is the input {given}: write the output elsewhere")
    if os.path.isfile(path) and not overwrite:
        raise SetupError(f"{option} {path} exists: give --overwrite to replace it, or another path")


def _check_report(report: str | None, overwrite: bool) -> None:
    """Before the first step: matplotlib imports, ``report`` is a directory this process can
    write (probed by creating it and a file in it, then removing them), and it holds no
    earlier files unless ``--overwrite``."""
    if not report:
        return
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise SetupError(
            f"--report needs matplotlib ({exc}): pip install 'kvsched[plots]', or drop --report"
        ) from None
    where = Path(report)
    if where.exists() and not where.is_dir():
        raise SetupError(f"--report {report}: exists and is not a directory")
    if where.is_dir() and any(where.iterdir()) and not overwrite:
        raise SetupError(
            f"--report {report}: the directory is not empty: give --overwrite to write over "
            "its files, or another directory"
        )
    made = [p for p in (where, *where.parents) if not p.exists()]  # the deepest first
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        raise SetupError(f"--report {report}: cannot write there: {exc.strerror or exc}") from None
    finally:
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()


# ---------------------------------------------------- options that would have no effect


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args: argparse.Namespace, *dests: str) -> list[str]:
    return [_option(d) for d in dests if getattr(args, d, None) is not None]


def _no_effect(option: str, needs: str) -> SetupError:
    return SetupError(f"{option} has no effect without {needs}: add {needs} or drop {option}")


def _check_run_options(args: argparse.Namespace) -> None:
    """Refuse the options ``demo`` and ``replay`` would silently ignore."""
    if args.model is not None and args.executor != "torch":
        raise _no_effect("--model", "--executor torch")
    if args.wait_subscribers and not args.publish:
        raise _no_effect("--wait-subscribers", "--publish")


_CHECKPOINT_OPTIONS = (
    "policies",
    "checkpoint_budget",
    "checkpoint_memory",
    "checkpoint_policy",
    "checkpoint_placement",
    "checkpoint_eviction",
    "checkpoint_interval",
)


def _sweep_key(args: argparse.Namespace) -> str:
    return str(args.sweep).partition("=")[0].strip() if args.sweep else ""


def _check_replay_options(args: argparse.Namespace) -> None:
    """Refuse the ``replay`` options that another option given overrides."""
    _check_run_options(args)
    if args.cost is not None and args.executor == "torch":
        raise SetupError("--cost sets the simulated executor's costs: drop it or --executor torch")
    key = _sweep_key(args)
    if key in SWEEP_KEYS and getattr(args, key.replace("-", "_"), None) is not None:
        raise SetupError(f"--{key} and --sweep {key}=...: the sweep sets it in every run; drop one")
    memory = key == "checkpoint-memory" or args.checkpoint_memory is not None
    budget = key == "checkpoint-budget" or args.checkpoint_budget is not None
    if memory and budget:
        raise SetupError(
            "--checkpoint-budget and --checkpoint-memory: the memory sets the number of "
            "checkpoints, the budget would be ignored; give one"
        )
    if args.policies is not None:
        for option in _given(
            args, "checkpoint_policy", "checkpoint_placement", "checkpoint_eviction"
        ):
            raise SetupError(f"--policies sets each run's rules: {option} has no effect with it")


def _check_config_options(args: argparse.Namespace, hybrid: bool, order: str, turns: str) -> None:
    """Refuse the options a config without them ignores: checkpoint options without a hybrid
    model, prefill-turn options without the TTFT order."""
    checkpoints = _given(args, *_CHECKPOINT_OPTIONS)
    if _sweep_key(args).startswith("checkpoint-"):
        checkpoints.append(f"--sweep {_sweep_key(args)}")
    if checkpoints and not hybrid:
        raise _no_effect(checkpoints[0], "--hybrid")
    for option in _given(args, "prefill_turns", "short_turns", "long_order"):
        if order != "ttft":
            raise _no_effect(option, "--order ttft")
    if args.short_turns is not None and turns != "interleave":
        raise _no_effect("--short-turns", "--prefill-turns interleave")


def _progress(quiet: bool) -> Progress:
    """A tqdm bar per run (disabled with ``quiet``)."""

    @contextlib.contextmanager
    def bar(desc: str, total: int) -> Iterator[Callable[[int], None]]:
        with tqdm(total=total, desc=desc, unit="req", disable=quiet, leave=False) as shown:

            def update(done: int) -> None:
                if done != shown.n:
                    shown.update(done - shown.n)

            yield update

    return bar


class _ReportError(Exception):
    """A report that cannot be written: exit 2 with this message."""


def _report(report: str, write: Callable[..., object], *args: Any) -> None:
    """``write(*args)``, a report writer: a failure to write it is ``_ReportError``."""
    try:
        write(*args)
    except (OSError, RuntimeError) as exc:
        raise _ReportError(f"cannot write the report to {report}: {exc}") from None


def _run_report(
    report: str, where: str | Path, title: str, result: ReplayResult, metrics: dict[str, Any]
) -> None:
    ttft = result.recorder.latencies()[0]
    _report(report, write_report, where, metrics, result.series, ttft, title)


def _finish(
    args: argparse.Namespace, title: str, result: ReplayResult, metrics: dict[str, Any]
) -> int:
    """Write the report, print the run's summary, then the report's error if it failed
    (exit 2): a failed report loses no result."""
    failed = None
    if args.report:
        try:
            _run_report(args.report, args.report, title, result, metrics)
        except _ReportError as exc:
            failed = str(exc)
    if args.json:
        print(json.dumps(metrics))
    else:
        print(format_table(title, metrics))
        if args.log:
            print(f"  {'event log':<26}{args.log}")
        if args.report and failed is None:
            print(f"  {'report':<26}{args.report}")
    return _fail(failed) if failed else 0


def _check_demo(args: argparse.Namespace) -> None:
    """Everything ``demo`` checks before its first step."""
    _check_run_options(args)
    _check_output("--log", args.log, args.overwrite)
    _check_report(args.report, args.overwrite)


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
        check=args.check,
        log=args.log,
        publish=args.publish,
        wait_subscribers=args.wait_subscribers,
        progress=_progress(args.quiet),
    )
    n = len(demo.workload.turns)
    title = f"kvsched demo: {n} chat turns"
    if args.external:
        title = f"kvsched demo --external: {n} chat turns, second engine"
    return _finish(args, title, demo.result, demo.metrics)


# ---------------------------------------------------------------------- replay


def _check_replay(args: argparse.Namespace) -> None:
    """Everything ``replay`` checks before reading the trace (the config's own checks follow
    it: a kvsched log's header may make the run hybrid or TTFT-ordered)."""
    _check_replay_options(args)
    if detect_format(args.trace, args.format) != "log":
        _check_config_options(
            args, args.hybrid, args.order or "fcfs", args.prefill_turns or "interleave"
        )
    _check_output("--log", args.log, args.overwrite, inputs=[args.trace])
    _check_report(args.report, args.overwrite)


def cmd_replay(args: argparse.Namespace) -> int:
    _check_replay(args)
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
    _check_config_options(args, config.hybrid, config.order, config.prefill_turns)
    name = Path(args.trace).name
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
        progress=_progress(args.quiet),
    )
    return _finish(args, f"kvsched replay: {name}", result, {**result.metrics, **setup.extra()})


def _replay_sweep(
    args: argparse.Namespace, setup: TraceReplay, config: SchedulerConfig, name: str
) -> int:
    key, values = setup.sweep if setup.sweep is not None else ("", [0])
    runs: list[dict[str, Any]] = []
    progress = _progress(args.quiet)
    failed = None  # the report's error: the runs go on, their table is printed, then exit 2
    for run in sweep_runs(setup, config, setup.sweep, check=args.check, progress=progress):
        runs.append(run.metrics)
        if args.report and failed is None:
            point = "_".join(filter(None, (run.policy, f"{key}={run.value}" if key else "")))
            where = Path(args.report) / point
            try:
                _run_report(args.report, where, f"{name}, {point}", run.result, run.metrics)
            except _ReportError as exc:
                failed = str(exc)
    if args.report and failed is None:
        try:
            _report(args.report, write_sweep, args.report, key, values, runs, name)
        except _ReportError as exc:
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
    return _fail(failed) if failed else 0


def cmd_diff(args: argparse.Namespace) -> int:
    try:
        result = diff_logs(args.log_a, args.log_b)
    except (CorruptLogError, SchemaVersionError, RecordDecodeError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot read {exc.filename or 'log'}: {exc.strerror or exc}")
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(format_diff(result, args.log_a, args.log_b))
    return 0 if result.identical else 1


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0: verified (a torn tail or crash padding after the last complete step is
    reported); 1: a divergence; 2: a damaged log, or one this kvsched cannot replay
    (unreadable, another schema version, an invalid config); 130: interrupted."""
    total = None if args.quiet else _count_records(args.log)
    try:
        with tqdm(desc="verify", unit="step", total=total, disable=args.quiet) as bar:
            result = verify_log(args.log, on_step=lambda n: bar.update(1))
    except VerifyInterrupted as exc:
        print(exc, file=sys.stderr)
        return 130
    except CorruptLogError as exc:
        return _fail(f"{exc} (the {exc.steps or 0} steps before it verified)")
    except LogError as exc:
        return _fail(str(exc), 2)
    except OSError as exc:
        return _fail(f"cannot read {args.log}: {exc.strerror or exc}")
    if result.torn_tail is not None:
        t = result.torn_tail
        print(
            f"torn tail at byte {t.offset} ({t.reason}); "
            f"verified the {result.steps} complete steps before it"
        )
    if result.padding:
        print(
            f"warning: {result.steps} complete steps, then {result.padding} zero bytes "
            "(crash padding)"
        )
    if result.divergence is not None:
        print(result.divergence.describe())
        print("1 divergence")
        return 1
    print(f"{result.steps} steps verified, 0 divergences")
    return 0


_PREFIX = struct.Struct("<III")


def _count_records(path: str) -> int | None:
    """The number of records in the event log at ``path``, counted from the frames' length
    prefixes alone (a progress total; None when the file cannot be read). Counting stops at
    the first prefix whose own checksum fails (a torn tail, zeros, damage)."""
    try:
        with open(path, "rb") as f:
            size, offset, frames = os.fstat(f.fileno()).st_size, HEADER_OFFSET, 0
            while offset + PREFIX_SIZE <= size:
                f.seek(offset)
                prefix = f.read(PREFIX_SIZE)
                length, _, check = _PREFIX.unpack(prefix)
                offset += PREFIX_SIZE + length
                if check != zlib.crc32(prefix[:8]) or offset > size:
                    break
                frames += 1
    except OSError:
        return None
    return max(frames - 1, 0)  # the first frame is the header


def cmd_watch(args: argparse.Namespace) -> int:
    """Exit 0: the stream was followed from its first step to its end without a gap (the
    view is the engine's cache); 1: it was not (joined late, gaps, or it was stopped by
    Ctrl-C or --timeout idle seconds: the summary and --dump are written all the same);
    2: the stream cannot be read."""
    if args.json and args.every is not None:
        raise SetupError("--every has no effect with --json (only the final summary is printed)")
    _check_output("--dump", args.dump, args.overwrite)
    show: Callable[[str], None] = (lambda line: None) if args.json else print
    every = 100 if args.every is None else args.every
    print(f"kvsched: watching {args.endpoint} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        watched = watch(args.endpoint, timeout_s=args.timeout, every=every, on_line=show)
    except (WireError, StreamError) as exc:
        return _fail(str(exc))
    if args.dump:
        try:
            dump(watched, args.dump)
        except OSError as exc:
            return _fail(f"cannot write {args.dump}: {exc.strerror or exc}")
    summary = watched.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        print("final " + summary_line(summary))
        print(_watch_verdict(watched))
    return 0 if watched.complete else 1


def _watch_verdict(watched: Watched) -> str:
    if watched.complete:
        return f"stream ended after {watched.records} steps: followed completely"
    why = []
    if watched.first_seq:
        why.append(f"joined at step message {watched.first_seq}")
    if watched.gaps:
        why.append(f"{len(watched.gaps)} gap(s): {watched.gaps[:3]}")
    if watched.header is None:
        why.append("no header received")
    if watched.stopped == "interrupted":
        why.append("interrupted (Ctrl-C)")
    elif watched.stopped is not None:
        why.append(watched.stopped)
    return f"incomplete view ({'; '.join(why) or 'the stream did not end'})"


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
            return _fail(str(exc))
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

        _check_output("--log", args.log, args.overwrite)
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
            return _fail(str(exc))
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
        return _fail(
            f"kvsched bench vllm needs vLLM, which {sys.executable} cannot import ({exc}); "
            "build its environment with scripts/vllm_env.sh, then run "
            ".venv-vllm/bin/kvsched bench vllm"
        )
    rows = []
    for running in args.running:
        rows += run_vllm_bench(running=running, samples=args.samples, rounds=args.rounds)
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks (prefix match, scheduler step)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, what in (
        ("match", "prefix match on lmdeploy's aligned exact-hit workload"),
        ("admit", "one Engine.step admitting B cached requests (identity and all; same workload)"),
    ):
        match = kinds.add_parser(name, help=what)
        match.add_argument(
            "--mode", choices=["ar", "ssm"], default="ar", help="attention or hybrid" + _DEFAULT
        )
        match.add_argument(
            "--batch", type=_int_in(1, MAX_BATCH), default=128, help="requests" + _DEFAULT
        )
        match.add_argument(
            "--context", type=_int_in(1, 1 << 24), default=65536, help="tokens each" + _DEFAULT
        )
        match.add_argument(
            "--block-size", type=_int_in(1, 1 << 16), default=64, help="tokens" + _DEFAULT
        )
        match.add_argument(
            "--warmup", type=_int_in(0, 1 << 20), default=2, help="untimed runs" + _DEFAULT
        )
        match.add_argument("--samples", type=COUNT, default=10, help="timed runs" + _DEFAULT)
        match.add_argument("--json", action="store_true")
    ident = kinds.add_parser(
        "identity", help="block identity of one prompt, beside one numpy.array_equal pass"
    )
    ident.add_argument(
        "--context", type=_int_in(1, 1 << 24), default=65536, help="prompt tokens" + _DEFAULT
    )
    ident.add_argument(
        "--block-size", type=_int_in(1, 1 << 16), default=64, help="tokens" + _DEFAULT
    )
    ident.add_argument(
        "--scheme", choices=IDENTITY_SCHEMES, default="kvs128", help="block identity" + _DEFAULT
    )
    ident.add_argument(
        "--warmup", type=_int_in(0, 1 << 20), default=20, help="untimed runs" + _DEFAULT
    )
    ident.add_argument("--samples", type=COUNT, default=500, help="timed runs" + _DEFAULT)
    ident.add_argument("--json", action="store_true")
    step = kinds.add_parser("step", help="one scheduler step with N running decode sequences")
    step.add_argument(
        "--running", type=_int_in(1, MAX_BATCH), default=1024, help="sequences" + _DEFAULT
    )
    step.add_argument(
        "--warmup", type=_int_in(0, 1 << 20), default=5, help="untimed steps" + _DEFAULT
    )
    step.add_argument("--samples", type=COUNT, default=200, help="timed steps" + _DEFAULT)
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
        type=_int_in(1, MAX_BATCH),
        nargs="+",
        default=[256, 1024],
        help="running sequences, one row each" + _DEFAULT,
    )
    vllm.add_argument("--samples", type=COUNT, default=100, help="timed steps" + _DEFAULT)
    vllm.add_argument(
        "--rounds", type=_int_in(1, 1000), default=3, help="interleaved rounds" + _DEFAULT
    )
    vllm.add_argument("--json", action="store_true")
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
    r.add_argument(
        "--executor", choices=["sim", "torch"], default="sim", help="sim: cost model" + _DEFAULT
    )
    r.add_argument("--model", metavar="DIR", help="checkpoint directory (--executor torch)")
    r.add_argument(
        "--cache-blocks",
        type=_int_in(2, MAX_BLOCKS),
        metavar="N",
        help="KV blocks (default: unbounded, never evicts)",
    )
    r.add_argument(
        "--block-size", type=_int_in(1, 1 << 16), metavar="B", help="tokens per block (default 64)"
    )
    r.add_argument(
        "--max-batch", type=_int_in(1, MAX_BATCH), metavar="N", help="running sequences (256)"
    )
    r.add_argument(
        "--max-prefill-tokens", type=_int_in(1, 1 << 24), metavar="N", help="default 8192"
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
        type=_int_in(1, 1 << 20),
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
    r.add_argument("--sweep", metavar="KEY=V1,V2", help=f"keys: {', '.join(SWEEP_KEYS)}")
    r.add_argument(
        "--checkpoint-budget",
        type=_int_in(0, 1 << 20),
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
        "lmdeploy, vllm-align, sglang)",
    )
    r.add_argument(
        "--checkpoint-placement",
        metavar="RULES",
        help=f"--hybrid: comma-separated placement rules of {', '.join(PLACEMENTS)}",
    )
    r.add_argument("--checkpoint-eviction", choices=list(EVICTIONS), help="--hybrid")
    r.add_argument(
        "--checkpoint-interval",
        type=_int_in(1, 1 << 31),
        metavar="N",
        help="tokens between interval saves",
    )
    r.add_argument(
        "--policies",
        metavar="P1,P2|all",
        help="run every sweep point once per checkpoint policy, side by side",
    )
    r.add_argument("--limit", type=COUNT, metavar="N", help="read only the first N requests")
    r.add_argument(
        "--speedup",
        type=_positive_float,
        default=1.0,
        metavar="F",
        help="divide arrival times by F (what-if: F times the load)" + _DEFAULT,
    )
    r.add_argument("--skip-bad-lines", action="store_true", help="count bad lines, skip them")
    r.add_argument("--log", metavar="OUT", help="record the run to this event log")
    _add_publish(r)
    r.add_argument("--report", metavar="DIR", help="write metrics JSON and PNG plots here")
    r.add_argument("--overwrite", action="store_true", help=_OVERWRITE)
    r.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    r.add_argument("--check", action="store_true", help="check invariants after every step")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_replay)


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo:,}, {hi:,}], got {value:,}")
        return value

    return parse


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


COUNT = _int_in(1, 1 << 40)  # a count of something (requests, samples, steps)
_DEFAULT = " (default: %(default)s)"
_OVERWRITE = "replace an existing --log file and write into a non-empty --report DIR"


def _add_publish(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--publish",
        metavar="ENDPOINT",
        help="publish the event stream over ZeroMQ, e.g. tcp://127.0.0.1:5557 (kvsched watch)",
    )
    p.add_argument(
        "--wait-subscribers",
        type=_int_in(0, 1 << 10),
        default=0,
        metavar="N",
        help="with --publish: wait (up to 10 s) for N subscribers before the first step" + _DEFAULT,
    )


def _add_watch(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    w = sub.add_parser(
        "watch",
        help="follow a published event stream: live admissions, hits and cache use",
        description="Subscribe to a stream published with --publish, rebuild the cache from "
        "its events and print a summary line every --every steps, then a final one.",
    )
    w.add_argument("endpoint", metavar="ENDPOINT", help="e.g. tcp://127.0.0.1:5557")
    w.add_argument("--every", type=COUNT, metavar="N", help="steps between lines (default: 100)")
    w.add_argument(
        "--timeout",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="stop after S idle seconds (the publisher died), as Ctrl-C does: the final line "
        "and --dump, exit 1" + _DEFAULT,
    )
    w.add_argument("--dump", metavar="FILE", help="write the rebuilt cache view as JSON")
    w.add_argument("--overwrite", action="store_true", help="replace an existing --dump FILE")
    w.add_argument("--json", action="store_true", help="print only the final summary as JSON")
    w.set_defaults(func=cmd_watch)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in multi-turn chat workload (simulated)")
    demo.add_argument("--log", help="record the run to this event log")
    _add_publish(demo)
    demo.add_argument(
        "--sessions", type=_int_in(1, 1 << 20), default=64, help="chat sessions" + _DEFAULT
    )
    demo.add_argument(
        "--turns", type=_int_in(1, 1 << 12), default=4, help="turns per session" + _DEFAULT
    )
    demo.add_argument(
        "--seed", type=_int_in(0, (1 << 63) - 1), default=0, help="workload seed" + _DEFAULT
    )
    demo.add_argument(
        "--cache-blocks", type=_int_in(2, MAX_BLOCKS), default=2048, help="KV blocks" + _DEFAULT
    )
    demo.add_argument(
        "--max-batch", type=_int_in(1, MAX_BATCH), default=64, help="running sequences" + _DEFAULT
    )
    demo.add_argument("--check", action="store_true", help="check invariants after every step")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument("--report", metavar="DIR", help="write metrics JSON and PNG plots here")
    demo.add_argument("--overwrite", action="store_true", help=_OVERWRITE)
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--executor",
        choices=["sim", "torch"],
        default="sim",
        help="sim: cost model; torch: a real forward pass (CPU or CUDA)" + _DEFAULT,
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
    _add_watch(sub)
    _add_bench(sub)
    return p


INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT, as a shell reports it)
STDOUT_CLOSED = 141  # exit status when stdout's reader went away (128 + SIGPIPE)


@contextlib.contextmanager
def on_interrupt(describe: Callable[[], str]) -> Iterator[None]:
    """Within the block, Ctrl-C ends the command with the one line ``kvsched: describe()``
    (e.g. "interrupted after N steps; ...") and exit status 130, printed by :func:`main`."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if exc.args:  # already described (e.g. the driver's RunInterrupted)
            raise
        raise KeyboardInterrupt(describe()) from None


def _interrupted(exc: KeyboardInterrupt) -> int:
    message = str(exc.args[0]) if exc.args else "interrupted"
    print(f"kvsched: {message}", file=sys.stderr)
    return INTERRUPTED


def _stdout_closed() -> int:
    """stdout's reader is gone (``| head``): stop quietly. stdout goes to /dev/null so the
    interpreter's final flush does not fail again (the Python docs' recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return STDOUT_CLOSED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvsched`` command: its exit status. Ordinary failures are one line
    ``kvsched: error: ...`` and 2 (or the command's own status); Ctrl-C is one line and 130
    (see :func:`on_interrupt`); a closed stdout (``| head``) ends quietly with 141; any other
    ``OSError`` (a file that cannot be read or written) is ``kvsched: error: FILE: reason``."""
    try:
        args = build_parser().parse_args(argv)
        code: int = args.func(args)
        sys.stdout.flush()  # inside: a reader gone before the last flush is caught here too
    except (SetupError, TraceError, LogOpenError, LogWriteError, _ReportError, WireError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except BrokenPipeError:
        return _stdout_closed()
    except OSError as exc:  # any other file a command could not read or write
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return _fail(f"{where}{exc.strerror or exc}")
    return code


if __name__ == "__main__":
    sys.exit(main())
