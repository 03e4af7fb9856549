"""kvsched's side of benchmarks/interleave.py (samples one at a time, its worker) and the
driver's pairing and ratios; lmdeploy's side only in a slow test that needs its venv."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsched.bench import admit
from kvsched.bench.admit import AdmitSampler, run_admit_bench
from kvsched.bench.match import MatchSampler, run_match_bench
from kvsched.bench.stats import interleave, paired_ratios
from kvsched.events import types as ev

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "benchmarks" / "interleave.py"
VENV = Path(os.environ.get("LMDEPLOY_BENCH_VENV", "/tmp/lmdeploy-bench-venv"))
ANCHOR = ROOT.parent / "shared" / "bench" / "lmdeploy" / "run.sh"


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.parametrize("mode", ["ar", "ssm"])
def test_the_admit_sampler_checks_the_same_hits_as_the_admit_benchmark(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[tuple[Any, ...]] = []
    check = admit._check_hits

    def spy(decisions: tuple[ev.Event, ...], batch: int, context: int, mode: str) -> None:
        check(decisions, batch, context, mode)  # raises unless all 4 hit 256 tokens
        kinds = sorted({type(d).__name__ for d in decisions})
        matched = [d.num_tokens for d in decisions if isinstance(d, ev.PrefixMatched)]
        checked.append((batch, context, mode, tuple(kinds), tuple(matched)))

    monkeypatch.setattr(admit, "_check_hits", spy)
    out = run_admit_bench(mode=mode, batch=4, context=256, warmup=1, samples=3)
    assert len(checked) == 4 and out["p50_ms"] > 0
    from_bench = list(checked)
    checked.clear()
    sampler = AdmitSampler(mode=mode, batch=4, context=256)
    times = [sampler.sample() for _ in range(4)]
    assert all(t > 0 for t in times)
    assert checked == from_bench  # the same steps, the same hits (4 x 256 tokens)
    assert checked[0][-1] == (256,) * 4
    assert not sampler.engine.has_work  # every sample's consumers finished in its undo


def test_the_match_sampler_hits_every_token_and_leaves_the_cache_as_it_was() -> None:
    sampler = MatchSampler(mode="ssm", batch=4, context=256)
    state = sampler.engine.state
    times = [sampler.sample() for _ in range(3)]  # undo asserts the hits and checkpoints
    assert all(t > 0 for t in times) and not sampler.decisions
    assert all(state.seqs.computed[s.row] == 0 or s.row < 0 for s in sampler.consumers)
    assert run_match_bench(mode="ssm", batch=4, context=256, warmup=0, samples=2)["p50_ms"] > 0


def test_a_sampler_refuses_an_unknown_mode_or_a_context_that_is_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        AdmitSampler(mode="x", batch=1, context=64)
    with pytest.raises(ValueError, match="multiple of the block size"):
        MatchSampler(mode="ar", batch=1, context=100)


def test_interleaving_alternates_the_order_and_drops_the_warm_ups() -> None:
    calls: list[str] = []

    def side(name: str) -> Any:
        def sample() -> float:
            calls.append(name)
            return float(len(calls))

        return sample

    a, b = interleave(side("a"), side("b"), warmup=2, samples=4)
    assert "".join(calls) == "abba" * 3
    # iterations 2..5 kept; a's and b's sample of the same iteration side by side
    assert a.tolist() == [5.0, 8.0, 9.0, 12.0] and b.tolist() == [6.0, 7.0, 10.0, 11.0]


def test_paired_ratios_are_the_ratio_of_medians_and_the_median_of_pair_ratios() -> None:
    out = paired_ratios(np.array([1.0, 2.0, 3.0, 10.0]), np.array([2.0, 6.0, 3.0, 40.0]))
    assert out == {"ratio_p50": 1.8, "ratio_pairs_p50": 2.5}  # 4.5 / 2.5; median(2, 3, 1, 4)


def test_the_pair_ratio_cancels_a_drift_that_both_sides_see() -> None:
    drift = np.array([1.0, 1.6, 1.6, 1.1, 1.0, 1.5, 1.6])  # the machine's speed, pair by pair
    ours = 10.0 * drift * np.array([1.0, 1.02, 0.99, 1.0, 1.01, 1.0, 0.98])
    theirs = 13.0 * drift
    assert paired_ratios(ours, theirs)["ratio_pairs_p50"] == pytest.approx(1.3, abs=0.01)


def test_paired_ratios_need_two_equally_long_series() -> None:
    with pytest.raises(ValueError, match="equally long"):
        paired_ratios(np.array([1.0, 2.0]), np.array([1.0]))
    with pytest.raises(ValueError, match="non-empty"):
        paired_ratios(np.array([]), np.array([]))


def test_the_kvsched_worker_prints_its_set_up_then_one_sample_per_command() -> None:
    worker = ROOT / "benchmarks" / "kvsched_worker.py"
    shape = ["--mode", "ssm", "--batch", "4", "--context", "256"]
    done = subprocess.run(
        [sys.executable, str(worker), "--what", "admit", *shape],
        input="sample\nsample\nsample\n",
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first, *samples = done.stdout.splitlines()
    info = json.loads(first)
    assert info["impl"] == "kvsched" and info["bench"] == "admit" and "Engine.step" in info["scope"]
    assert len(samples) == 3 and all(float(s) > 0 for s in samples)


def test_the_driver_names_a_missing_anchor(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(DRIVER), "--mode", "ar", "--batch", "1", "--context", "64"],
        capture_output=True,
        text=True,
        env={**_env(), "LMDEPLOY_ANCHOR": str(tmp_path / "run.sh")},
        timeout=60,
    )
    assert done.returncode != 0 and "anchor not found" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    not (VENV / ".ready").is_file() or not ANCHOR.is_file(),
    reason="needs the lmdeploy anchor and its venv (run ../shared/bench/lmdeploy/run.sh once)",
)
def test_the_driver_interleaves_lmdeploy_and_kvsched_on_a_tiny_shape() -> None:
    done = subprocess.run(
        [sys.executable, str(DRIVER), "--mode", "ssm", "--batch", "4", "--context", "256",
         "--samples", "4", "--warmup", "1"],
        capture_output=True,
        text=True,
        env={**_env(), "LMDEPLOY_ANCHOR": str(ANCHOR)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert len(out["samples_ms"]["lmdeploy"]) == len(out["samples_ms"]["kvsched"]) == 4
    assert out["ratio_p50"] > 0 and out["ratio_pairs_p50"] > 0
    assert "BlockTrie.match" in out["scope"]["lmdeploy"]
