"""kvsched beside lmdeploy 0.18.0's prefix match, their samples interleaved one by one:

    python3 benchmarks/interleave.py --mode ssm|ar --batch B --context L [--what admit|match]
                                     [--block-size 64] [--warmup 2] [--samples 20]

Two worker processes hold the two set-ups: benchmarks/kvsched_worker.py (this checkout's
``src``, with the project's python: ``kvsched bench admit``'s sampler, or ``bench match``'s
with ``--what match``) and benchmarks/lmdeploy_worker.py (the anchor's virtual environment and
environment, as ../shared/bench/lmdeploy/run.sh sets them: lmdeploy's ``BlockTrie.match()``).
The set-ups run one after the other (lmdeploy's, then kvsched's), then each iteration takes
one sample of each, kvsched first on even iterations and lmdeploy first on odd ones, so both
see the same machine (its speed drifts over seconds) and neither always runs first; only one
process works at a time. The first ``--warmup`` iterations are dropped.

Prints one JSON line: each side's p50/p99/min (ms), ``ratio_p50`` (lmdeploy p50 / kvsched
p50) and ``ratio_pairs_p50`` (the median of the iterations' own lmdeploy / kvsched ratios;
above 1: kvsched is faster), the two timed scopes and every sample.

The anchor is LMDEPLOY_ANCHOR (default ../shared/bench/lmdeploy/run.sh beside this
checkout); its environment is LMDEPLOY_BENCH_VENV / LMDEPLOY_BENCH_SRC (run.sh's defaults,
/tmp/lmdeploy-bench-venv and /tmp/lmdeploy-bench-src). When they are missing, run.sh is run
once on a tiny shape to build them (1-2 minutes, from the package registry).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))  # this checkout's kvsched (the one its worker runs)

from kvsched.bench.stats import interleave, paired_ratios, summarize  # noqa: E402

THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class WorkerError(RuntimeError):
    pass


class Worker:
    """A benchmark process: its set-up is done when it has printed its one JSON line; then
    each ``sample()`` writes ``sample`` and reads back one sample's milliseconds."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.info: dict[str, Any] = json.loads(self._read("its set-up"))

    def _read(self, what: str) -> str:
        out: IO[str] | None = self.proc.stdout
        line = out.readline() if out is not None else ""
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"the {self.name} worker exited ({code}) before {what} (see above)")
        return line

    def sample(self) -> float:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("sample\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerError(f"the {self.name} worker is gone") from None
        return float(self._read("a sample"))

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def anchor_paths() -> tuple[Path, Path, Path]:
    """run.sh, the anchor's venv and lmdeploy's unpacked source (run.sh's own defaults)."""
    anchor = Path(
        os.environ.get("LMDEPLOY_ANCHOR", HERE.parent.parent / "shared/bench/lmdeploy/run.sh")
    ).resolve()
    venv = Path(os.environ.get("LMDEPLOY_BENCH_VENV", "/tmp/lmdeploy-bench-venv"))
    src = Path(os.environ.get("LMDEPLOY_BENCH_SRC", "/tmp/lmdeploy-bench-src"))
    return anchor, venv, src


def ensure_anchor(anchor: Path, venv: Path, src: Path) -> None:
    """Fail clearly without the anchor; build its environment with run.sh when missing."""
    if not (anchor.is_file() and (anchor.parent / "bench_match.py").is_file()):
        raise SystemExit(
            f"interleave: lmdeploy anchor not found: {anchor} (set LMDEPLOY_ANCHOR to its run.sh)"
        )

    def ready() -> bool:
        return (
            os.access(venv / "bin/python", os.X_OK)
            and (venv / ".ready").is_file()
            and (src / "lmdeploy/pytorch/paging").is_dir()
        )

    if ready():
        return
    print(
        f"interleave: the anchor's environment ({venv}, {src}) is missing: building it with "
        f"{anchor} once (1-2 minutes, from the package registry)",
        file=sys.stderr,
    )
    tiny = ["--mode", "ar", "--batch", "1", "--context", "64", "--warmup", "0", "--samples", "1"]
    built = subprocess.run(["bash", str(anchor), *tiny], stdout=subprocess.DEVNULL)
    if built.returncode or not ready():
        raise SystemExit(
            f"interleave: building the anchor's environment failed (exit {built.returncode}); "
            f"run `{anchor} --mode ar --batch 1 --context 64` once and read its errors"
        )


def start_workers(args: argparse.Namespace) -> tuple[Worker, Worker]:
    """lmdeploy's worker, then (once its set-up is done) kvsched's: set-ups never overlap."""
    anchor, venv, src = anchor_paths()
    ensure_anchor(anchor, venv, src)
    shape = ["--mode", args.mode, "--batch", str(args.batch), "--context", str(args.context)]
    shape += ["--block-size", str(args.block_size)]
    theirs_env = {
        **os.environ,
        **THREADS,
        "LMDEPLOY_SRC": str(src),
        "PYTHONPATH": str(anchor.parent),
        "PYTHONHASHSEED": "0",
    }
    theirs = Worker(
        "lmdeploy",
        [str(venv / "bin/python"), str(HERE / "lmdeploy_worker.py"), *shape],
        theirs_env,
    )
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    ours_env = {**os.environ, **THREADS, "PYTHONPATH": path}
    try:
        ours = Worker(
            "kvsched",
            [sys.executable, str(HERE / "kvsched_worker.py"), "--what", args.what, *shape],
            ours_env,
        )
    except BaseException:
        theirs.close()
        raise
    return ours, theirs


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    ours, theirs = start_workers(args)
    try:
        setup_s = time.perf_counter() - t0
        if not ours.info.get("native_identity", True):
            print(
                f"interleave: warning: kvsched runs without its native identity kernel "
                f"({SRC / 'kvsched'} has no built _kvs128 extension): `pip install -e .`",
                file=sys.stderr,
            )
        t1 = time.perf_counter()
        ours_ms, theirs_ms = interleave(ours.sample, theirs.sample, args.warmup, args.samples)
        sampling_s = time.perf_counter() - t1
    finally:
        ours.close()
        theirs.close()
    return {
        "bench": "interleave",
        "what": args.what,
        "mode": args.mode,
        "batch": args.batch,
        "context": args.context,
        "block_size": args.block_size,
        "warmup": args.warmup,
        "samples": args.samples,
        "order": "kvsched,lmdeploy on even iterations; lmdeploy,kvsched on odd ones",
        "lmdeploy": {**summarize(theirs_ms), "build_s": theirs.info["build_s"]},
        "kvsched": {
            **summarize(ours_ms),
            "build_s": ours.info["build_s"],
            "identity": ours.info.get("identity"),
            "native_identity": ours.info.get("native_identity"),
        },
        **paired_ratios(ours_ms, theirs_ms),
        "scope": {"lmdeploy": theirs.info["scope"], "kvsched": ours.info["scope"]},
        "setup_s": round(setup_s, 1),
        "sampling_s": round(sampling_s, 1),
        "samples_ms": {
            "lmdeploy": [round(float(x), 3) for x in theirs_ms],
            "kvsched": [round(float(x), 3) for x in ours_ms],
        },
    }


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--mode", choices=["ar", "ssm"], required=True)
    p.add_argument("--batch", type=positive, required=True)
    p.add_argument("--context", type=positive, required=True)
    p.add_argument("--what", choices=["admit", "match"], default="admit")
    p.add_argument("--block-size", type=positive, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--samples", type=positive, default=20)
    args = p.parse_args(argv)
    if args.context % args.block_size:
        p.error("aligned workload: --context must be a multiple of --block-size")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        out = run(args)
    except WorkerError as exc:
        print(f"interleave: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
