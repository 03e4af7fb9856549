"""The report's tables and plots: each plot is inspected through the matplotlib Figure that
``write_report`` / ``write_sweep`` saved (axes, limits, ticks, artists), not through pixels."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (kvsched[plots])")

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from kvsched.replay.report import format_sweep, summary_rows, write_report, write_sweep

POLICIES = ("kvsched", "lmdeploy", "vllm-align", "sglang")
BUDGETS = [16, 64, 256, 1024]
STATE_BYTES = 77_266_944  # 73.7 MiB, one state of the default hybrid model


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> dict[str, Figure]:
    """Every Figure saved while the test runs, by file name."""
    figures: dict[str, Figure] = {}
    real = Figure.savefig

    def savefig(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        figures[Path(fname).name] = self
        real(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def a_run(policy: str, value: int, hit: float, p50: float, p99: float) -> dict[str, Any]:
    return {
        "checkpoint_policy": policy,
        "sweep_key": "checkpoint-budget",
        "sweep_value": value,
        "state_memory_bytes": value * STATE_BYTES,
        "hybrid": True,
        "token_hit_rate": hit,
        "ttft_p50_s": p50,
        "ttft_p99_s": p99,
        "ideal_hit_rate": 0.055,
        "kv_block_evictions": 0,
        "checkpoint_evictions": 1000 // value,
        "evictions": 0,
    }


def policy_runs() -> list[dict[str, Any]]:
    """Hit rates of 0.2 to 5 %, TTFT p50 about 200 ms and p99 about 1.4 s (the first 400
    Mooncake requests, hybrid)."""
    return [
        a_run(policy, value, 0.002 + 0.012 * i + 0.004 * j, 0.2 - 0.003 * i, 1.37)
        for j, policy in enumerate(POLICIES)
        for i, value in enumerate(BUDGETS)
    ]


def policies_figure(tmp_path: Path, saved: dict[str, Figure]) -> Figure:
    write_sweep(tmp_path, "checkpoint-budget", BUDGETS, policy_runs(), "trace")
    return saved["sweep.png"]


def cache_sweep_figure(tmp_path: Path, saved: dict[str, Figure]) -> Figure:
    values = [4096, 16384, 65536]
    runs = [
        {**a_run("", v, hit, p50, 1.075), "sweep_key": "cache-blocks", "hybrid": False}
        for v, hit, p50 in zip(values, (0.007, 0.022, 0.096), (0.184, 0.181, 0.163), strict=True)
    ]
    write_sweep(tmp_path, "cache-blocks", values, runs, "trace")
    return saved["sweep.png"]


def hit_axes(fig: Figure) -> Any:
    (ax,) = [ax for ax in fig.axes if "hit rate" in ax.get_ylabel()]
    return ax


# ------------------------------------------------------------------- sweep.png


def test_the_sweep_plot_gives_hit_rate_and_each_ttft_percentile_a_panel_of_its_own(
    tmp_path: Path, saved: dict[str, Figure]
):
    fig = cache_sweep_figure(tmp_path, saved)

    assert [ax.get_ylabel() for ax in fig.axes] == [
        "token hit rate (%)",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
    ]
    p50 = [line.get_ydata() for line in fig.axes[1].get_lines()]
    assert len(p50) == 1 and list(p50[0]) == pytest.approx([184, 181, 163])
    hits = [list(line.get_ydata()) for line in fig.axes[0].get_lines() if len(line.get_ydata())]
    assert [0.7, 2.2, 9.6] in [pytest.approx(h) for h in hits]


def test_the_sweep_plots_p99_panel_draws_each_runs_p99_not_its_p50(
    tmp_path: Path, saved: dict[str, Figure]
):
    fig = cache_sweep_figure(tmp_path, saved)  # p50 184, 181, 163 ms; p99 1,075 ms each

    (p99,) = [line.get_ydata() for line in fig.axes[2].get_lines()]
    assert list(p99) == pytest.approx([1075, 1075, 1075])
    assert fig.axes[2].get_ylim()[1] >= 1075


def test_sweep_plots_tick_the_swept_values_labelled_as_swept(
    tmp_path: Path, saved: dict[str, Figure]
):
    fig = cache_sweep_figure(tmp_path, saved)
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4,096", "16,384", "65,536"]
        assert ax.get_xlabel() == "cache-blocks"

    fig = policies_figure(tmp_path / "p", saved)
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert [label.split("\n")[0] for label in labels] == ["16", "64", "256", "1,024"]
        assert labels[0].split("\n")[1] == "(1.15 GiB)"  # 16 states of 73.7 MiB
        assert ax.get_xscale() == "linear" and list(ax.get_xticks()) == [0, 1, 2, 3]


def test_a_memory_sweep_ticks_its_sizes_in_gib(tmp_path: Path, saved: dict[str, Figure]):
    sizes = [10 << 30, 20 << 30, 80 << 30]
    runs = [
        {**a_run(p, v, 0.03, 0.2, 1.3), "sweep_key": "checkpoint-memory"}
        for p in POLICIES[:2]
        for v in sizes
    ]
    write_sweep(tmp_path, "checkpoint-memory", sizes, runs, "trace")

    ax = saved["sweep.png"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["10 GiB", "20 GiB", "80 GiB"]


def test_the_policies_plot_scales_hit_rate_to_the_data_from_zero(
    tmp_path: Path, saved: dict[str, Figure]
):
    fig = policies_figure(tmp_path, saved)

    top = max(100 * m["token_hit_rate"] for m in policy_runs())  # 5 %
    bottom, ceiling = hit_axes(fig).get_ylim()
    assert bottom == 0 and top < ceiling < 1.5 * top
    for ax in fig.axes[1:]:
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0


def test_the_policies_plot_keeps_its_legend_off_the_data(tmp_path: Path, saved: dict[str, Figure]):
    fig = policies_figure(tmp_path, saved)
    fig.canvas.draw()

    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    names = [t.get_text() for t in legend.get_texts()]
    assert names[:4] == list(POLICIES)
    assert "unbounded ideal: sequential, infinite cache (5.5 %)" in names
    box = legend.get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)


def test_policies_with_equal_results_stay_visible_side_by_side(
    tmp_path: Path, saved: dict[str, Figure]
):
    fig = policies_figure(tmp_path, saved)
    p99 = [line for line in fig.axes[2].get_lines() if len(line.get_xdata())]

    assert len(p99) == 4  # every policy at 1.37 s
    assert len({line.get_marker() for line in p99}) == 4
    assert len({tuple(line.get_xdata()) for line in p99}) == 4  # nudged sideways


def test_the_sweep_table_has_kv_block_and_checkpoint_eviction_columns():
    text = format_sweep("checkpoint-budget", policy_runs()[:2])
    head, first, second = text.splitlines()

    assert "KV evictions" in head and "ckpt evictions" in head
    assert first.split()[-2:] == ["0", "62"] and second.split()[-2:] == ["0", "15"]


def test_the_summary_table_counts_kv_block_and_checkpoint_evictions():
    metrics = {**demo_metrics(), "kv_block_evictions": 3, "checkpoint_evictions": 7}

    assert ("evictions", "3 KV blocks, 7 checkpoints") in summary_rows(metrics)


# ------------------------------------------------------------------- ttft.png


def demo_metrics() -> dict[str, Any]:
    keys = ("requests", "finished", "rejected", "prompt_tokens", "generated_tokens")
    keys += ("prefill_tokens", "preemptions", "max_waiting", "steps", "block_size")
    metrics: dict[str, Any] = dict.fromkeys(keys, 1)
    for name in ("token_hit_rate", "hit_rate_local_kv", "hit_rate_checkpoint"):
        metrics[name] = 0.5
    for q in ("p50", "p90", "p99"):
        metrics[f"ttft_{q}_s"] = metrics[f"tpot_{q}_s"] = 0.01
    metrics.update(
        hit_rate_external=0.0,
        throughput_tok_s=1.0,
        max_cache_use=0.5,
        max_cache_held=0.5,
        sim_time_s=1.0,
        wall_time_s=1.0,
        cache_blocks=101,
        kv_block_evictions=0,
        checkpoint_evictions=0,
        evictions=0,
    )
    return metrics


def a_series(steps: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    clock = np.cumsum(rng.uniform(0.001, 0.01, steps))
    used = np.minimum(np.arange(steps) // 10, 100)
    return {
        "clock": clock,
        "waiting": rng.integers(0, 5, steps),
        "running": rng.integers(0, 20, steps),
        "used": used,
        "held": used,
        "hit_tokens": rng.integers(0, 64, steps),
        "query_tokens": np.full(steps, 64),
    }


def report(
    tmp_path: Path,
    saved: dict[str, Figure],
    steps: int = 300,
    ttft_range: tuple[float, float] = (0.0049, 0.0183),  # 4.9 to 18.3 ms
    **metrics: Any,
) -> dict[str, Figure]:
    lo, hi = np.log10(ttft_range)
    ttft = 10 ** np.random.default_rng(1).uniform(lo, hi, 256)
    write_report(tmp_path, {**demo_metrics(), **metrics}, a_series(steps), ttft, "demo")
    return saved


def test_a_ttft_of_0_ms_is_plotted_at_the_log_axis_left_edge_without_a_warning(
    tmp_path: Path, saved: dict[str, Figure]
):
    ttft = np.array([0.0, 0.0, 0.004, 0.012, 0.3])  # a cached prompt can answer at once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_report(tmp_path, demo_metrics(), a_series(50), ttft, "demo")
    _hist, cdf = saved["ttft.png"].axes

    (line,) = cdf.get_lines()[:1]
    assert 0 < cdf.get_xlim()[0] <= min(line.get_xdata())
    assert list(line.get_ydata()) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


@pytest.mark.parametrize("span", [(0.0049, 0.0183), (0.0031, 2.4), (0.0002, 60.0)])
def test_the_ttft_plot_uses_ms_throughout_with_plain_ticks_that_do_not_overlap(
    tmp_path: Path, saved: dict[str, Figure], span: tuple[float, float]
):
    fig = report(tmp_path, saved, ttft_range=span)["ttft.png"]
    fig.canvas.draw()
    hist, cdf = fig.axes

    for ax in (hist, cdf):
        assert "(ms" in ax.get_xlabel() and "(s)" not in ax.get_xlabel()
        shown = [t for t in ax.get_xticklabels(minor=True) + ax.get_xticklabels() if t.get_text()]
        shown = [t for t in shown if ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
        assert len(shown) >= 3
        assert all("mathdefault" not in t.get_text() for t in shown)
        for a, b in itertools.combinations(shown, 2):
            assert not a.get_window_extent().overlaps(b.get_window_extent()), (a, b)
    bars = [p.get_x() for p in hist.patches]
    assert 900 * span[0] < min(bars) < 1100 * span[0] and max(bars) < 1000 * span[1]  # ms
    assert all(t.get_text().endswith(" ms") for t in hist.get_legend().get_texts())


# ------------------------------------------------------------------- cache.png


def test_the_cache_plot_shows_held_blocks_distinct_from_blocks_holding_kv_when_equal(
    tmp_path: Path, saved: dict[str, Figure]
):
    fig = report(tmp_path, saved)["cache.png"]
    use = fig.axes[1]

    (held,) = [line for line in use.get_lines() if "held by" in str(line.get_label())]
    assert held.get_linestyle() == "--"
    assert "= blocks holding KV" in str(held.get_label())
    fills = [c for c in use.collections if isinstance(c, PolyCollection)]
    assert [str(c.get_label()).split("\n")[0] for c in fills] == ["blocks holding KV"]


def test_the_cache_plot_marks_the_whole_trace_ideal_at_the_end_of_the_cumulative_line(
    tmp_path: Path, saved: dict[str, Figure]
):
    fig = report(tmp_path, saved, ideal_hit_rate=0.651)["cache.png"]
    hits = fig.axes[0]
    clock_end = a_series(300)["clock"][-1]

    ideal = [line for line in hits.get_lines() if "ideal" in str(line.get_label())]
    assert len(ideal) == 1 and "whole trace" in str(ideal[0].get_label())
    assert list(ideal[0].get_xdata()) == [pytest.approx(clock_end)]  # one mark, not a line
    assert list(ideal[0].get_ydata()) == [pytest.approx(65.1)]


# ------------------------------------------------------------------- queue.png


def test_the_queue_plot_of_a_long_run_draws_each_time_bucket_once(
    tmp_path: Path, saved: dict[str, Figure]
):
    series = a_series(50_000)
    fig = report(tmp_path, saved, steps=50_000)["queue.png"]
    (ax,) = fig.axes

    lines = [line for line in ax.get_lines() if len(line.get_xdata())]
    assert {str(line.get_label()) for line in lines} == {"running: mean", "waiting: mean"}
    assert all(len(line.get_xdata()) <= 400 for line in lines)
    running = next(line for line in lines if line.get_label() == "running: mean")
    mean = float(np.nanmean(running.get_ydata()))
    assert mean == pytest.approx(float(series["running"].mean()), rel=0.05)
    assert ax.get_ylim()[1] >= series["running"].max()  # the band reaches each bucket's max
