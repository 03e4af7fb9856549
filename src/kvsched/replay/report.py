"""Replay reports: the summary table, the metrics JSON and the PNG plots.

Plots need matplotlib (the ``plots`` extra); it is imported only when a report is written,
with the non-interactive Agg backend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.replay.sweep_table import (
    UNBOUNDED_BUDGET,
    axis_label,
    gib,
    point_label,
    runs_at,
    sweep_markdown,
    sweep_points,
)

PLOTS = ("ttft.png", "cache.png", "queue.png")
SWEEP_PLOT = "sweep.png"
SWEEP_TABLE = "sweep.md"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.1f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def summary_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        (
            "requests",
            f"{m['requests']:,} ({m['finished']:,} finished, {m['rejected']:,} rejected"
            + (f", {m['aborted']:,} aborted)" if m.get("aborted") else ")"),
        ),
    ]
    for reason, count in m.get("rejections", {}).items():
        rows.append(("  rejected", f"{count:,} x {reason}"))
    rows += [
        ("prompt tokens", f"{m['prompt_tokens']:,}"),
        ("generated tokens", f"{m['generated_tokens']:,}"),
        ("prefill tokens computed", f"{m['prefill_tokens']:,}"),
        ("prefix hit rate", f"{_pct(m['token_hit_rate'])} of prompt tokens"),
        ("  local KV", _pct(m["hit_rate_local_kv"])),
        ("  checkpoint (hybrid)", _pct(m["hit_rate_checkpoint"])),
        ("  external", f"{_pct(m['hit_rate_external'])} (loaded from the KV store)"),
        ("  KV unusable (hybrid)", f"{_pct(m.get('kv_only_unusable_rate', 0.0))} (no checkpoint)"),
    ]
    if m.get("ideal_hit_rate") is not None:
        rows.append(("  sequential ideal", f"{_pct(m['ideal_hit_rate'])} (infinite cache)"))
    rows += [
        (
            "TTFT p50 / p90 / p99",
            f"{_ms(m['ttft_p50_s'])} / {_ms(m['ttft_p90_s'])} / {_ms(m['ttft_p99_s'])}",
        ),
        (
            "TPOT p50 / p90 / p99",
            f"{_ms(m['tpot_p50_s'])} / {_ms(m['tpot_p90_s'])} / {_ms(m['tpot_p99_s'])}",
        ),
        ("throughput (clock)", f"{m['throughput_tok_s']:,.0f} output tok/s"),
        ("preemptions", f"{m['preemptions']:,}"),
        (
            "evictions",
            f"{m['kv_block_evictions']:,} KV blocks, {m['checkpoint_evictions']:,} checkpoints",
        ),
        (
            "cache",
            f"{m['cache_blocks']:,} blocks x {m['block_size']} tokens, "
            f"peak use {_pct(m['max_cache_use'])} (held {_pct(m['max_cache_held'])})",
        ),
        ("peak queue", f"{m['max_waiting']:,} waiting"),
        ("steps", f"{m['steps']:,}"),
        ("clock (executor time)", f"{m['sim_time_s']:,.2f} s"),
        (
            "wall time",
            f"{m['wall_time_s']:.2f} s ({m['steps'] / max(m['wall_time_s'], 1e-9):,.0f} steps/s)",
        ),
    ]
    if m.get("bad_lines"):
        rows.append(("bad lines skipped", f"{m['bad_lines']:,}"))
    if m.get("out_of_order"):
        rows.append(("out-of-order lines", f"{m['out_of_order']:,} (ordered by timestamp)"))
    return rows


def format_table(title: str, m: dict[str, Any]) -> str:
    lines = [title]
    lines += [f"  {name:<26}{value}" for name, value in summary_rows(m)]
    return "\n".join(lines)


def format_sweep(key: str, runs: Sequence[dict[str, Any]]) -> str:
    """One line per run: the checkpoint policy (when compared), the sweep value (when
    swept), hit rate, TTFT and evictions (KV blocks and checkpoints)."""
    policies = any(m.get("checkpoint_policy") for m in runs)
    width = max([20, len(key), *(len(_value_label(key, m)) for m in runs)]) if key else 0
    head = f"  {'policy':<13}" if policies else ""
    head += f"{key:>{width}}" if key else ""
    head += f"  {'hit rate':>9}  {'TTFT p50':>10}  {'TTFT p99':>10}"
    head += f"  {'KV evictions':>12}  {'ckpt evictions':>14}"
    lines = [head]
    for m in runs:
        line = f"  {m.get('checkpoint_policy', ''):<13}" if policies else ""
        line += f"{_value_label(key, m):>{width}}" if key else ""
        line += (
            f"  {_pct(m['token_hit_rate']):>9}  {_ms(m['ttft_p50_s']):>10}"
            f"  {_ms(m['ttft_p99_s']):>10}  {m['kv_block_evictions']:>12,}"
            f"  {m['checkpoint_evictions']:>14,}"
        )
        lines.append(line)
    return "\n".join(lines)


def _value_label(key: str, m: dict[str, Any]) -> str:
    """A run's sweep value in the text table (``KEY=`` in front under several keys)."""
    own = m.get("sweep_key", key)
    text = point_label(own, m["sweep_value"])
    return f"{own}={text}" if "+" in key else text


# ----------------------------------------------------------------------- files


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - the plots extra is missing
        raise RuntimeError("plots need matplotlib: pip install 'kvsched[plots]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _downsample(series: dict[str, np.ndarray], points: int = 2000) -> dict[str, list[float]]:
    n = len(series["clock"])
    idx = np.unique(np.linspace(0, n - 1, min(n, points)).astype(np.int64))
    return {k: np.asarray(v)[idx].tolist() for k, v in series.items()}


def _windows(clock: np.ndarray, values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    sums, _ = np.histogram(clock, bins=edges, weights=values)
    return sums


DPI = 90
_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small"}
QUEUE_BUCKETS = 400  # queue.png: at most this many time buckets (min, mean, max each)


def write_report(
    out_dir: str | Path,
    metrics: dict[str, Any],
    series: dict[str, np.ndarray],
    ttft: np.ndarray,
    title: str,
) -> list[Path]:
    """metrics.json, timeseries.json and the plots; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "metrics.json", metrics)
    write_json(out / "timeseries.json", _downsample(series))
    plt = pyplot()
    figures = (
        ttft_figure(ttft, title),
        cache_figure(metrics, series, title),
        queue_figure(series, title),
    )
    for name, fig in zip(PLOTS, figures, strict=True):
        fig.savefig(out / name, dpi=DPI)
        plt.close(fig)
    return [out / "metrics.json", out / "timeseries.json", *(out / p for p in PLOTS)]


# ----------------------------------------------------------------------- axes


def _pct_top(values: Sequence[float]) -> float:
    """Top of a percentage axis that starts at 0: the data's peak and a margin, at least
    1 %, at most 105 %."""
    finite = [float(v) for v in values if np.isfinite(v)]
    return float(min(max(max(finite, default=0.0) * 1.15, 1.0), 105.0))


def _top(values: Sequence[float]) -> float:
    """Top of an axis that starts at 0: the data's peak and a margin."""
    finite = [float(v) for v in values if np.isfinite(v)]
    return max(max(finite, default=0.0) * 1.15, 1.0)


def _plain(value: float, _pos: object = None) -> str:
    return f"{value:,g}"


def _log_ms_axis(ax: Any, lo: float, hi: float) -> None:
    """A log x axis in ms with plain-number labels (on 1-2-5 ticks; 1-10-100 past three
    decades, 1-2-3-...-9 under one) and unlabelled minor ticks: no overlapping labels, no
    powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    decades = np.log10(hi / lo)
    subs: tuple[float, ...] = (
        (1.0,) if decades > 3 else (1.0, 2.0, 5.0) if decades > 1 else tuple(range(1, 10))
    )
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(_plain))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)


# ----------------------------------------------------------------------- ttft.png


def ttft_figure(ttft: np.ndarray, title: str) -> Any:
    """TTFT histogram (log-spaced bins) and CDF in ms, p50/p90/p99 marked."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ms = 1000 * np.asarray(ttft, dtype=np.float64)
    if len(ms):
        lo = max(float(ms.min()), 0.1)
        hi = max(float(ms.max()), lo * 1.5)
        ax1.hist(np.clip(ms, lo, hi), bins=np.geomspace(lo, hi, 50), color="#4477aa")
        xs = np.sort(np.maximum(ms, lo))  # a log axis: 0 ms shows at its left edge
        ax2.plot(xs, np.arange(1, len(xs) + 1) / len(xs), color="#4477aa")
        for q, style in ((50, "-"), (90, "--"), (99, ":")):
            v = float(np.percentile(ms, q))
            for ax in (ax1, ax2):
                ax.axvline(v, color="#cc3311", linestyle=style, label=f"p{q} {v:,.1f} ms")
        for ax in (ax1, ax2):
            _log_ms_axis(ax, lo / 1.1, hi * 1.1)
        ax1.legend()
    ax1.set(xlabel="TTFT (ms, log scale)", ylabel="requests", title="TTFT histogram")
    ax2.set(xlabel="TTFT (ms, log scale)", ylabel="fraction of requests", title="TTFT CDF")
    ax2.set_ylim(0, 1.02)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------- cache.png


def cache_figure(metrics: dict[str, Any], series: dict[str, np.ndarray], title: str) -> Any:
    """Hit rate per window and cumulative (the whole-trace sequential ideal as a mark at the
    cumulative line's end, where the two compare); cache use over time."""
    plt = pyplot()
    clock = np.asarray(series["clock"], dtype=np.float64)
    usable = max(int(metrics["cache_blocks"]) - 1, 1)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True, layout="constrained")
    span = float(clock[-1]) if len(clock) else 1.0
    edges = np.linspace(0.0, max(span, 1e-9), 51)
    hit = _windows(clock, series["hit_tokens"], edges)
    query = _windows(clock, series["query_tokens"], edges)
    with np.errstate(invalid="ignore", divide="ignore"):
        window = 100 * np.where(query > 0, hit / query, np.nan)
    cum_q = np.cumsum(series["query_tokens"])
    cum_h = np.cumsum(series["hit_tokens"])
    cumulative = 100 * np.where(cum_q > 0, cum_h / np.maximum(cum_q, 1), np.nan)
    width = edges[1] - edges[0]
    ax1.bar(
        edges[:-1],
        np.nan_to_num(window),
        width=width,
        align="edge",
        color="#88ccaa",
        edgecolor="white",
        label=f"per {width:,.1f} s window",
    )
    ax1.plot(clock, cumulative, color="#117733", label="cumulative (since the start)")
    peaks = [*window, *cumulative]
    ideal = metrics.get("ideal_hit_rate")
    if ideal is not None and len(clock):
        ax1.plot(
            [clock[-1]],
            [100 * ideal],
            marker="*",
            markersize=14,
            linestyle="none",
            color="#cc3311",
            label=f"sequential ideal, whole trace:\n{100 * ideal:.1f} % (compare with the\n"
            "cumulative line's end)",
        )
        peaks.append(100 * ideal)
    ax1.set(ylabel="token hit rate (%)", ylim=(0, _pct_top(peaks)))
    ax1.set_title(f"{title}: prefix hit rate and cache use")
    ax1.legend(**_OUTSIDE)
    used = 100 * np.asarray(series["used"]) / usable
    held = 100 * np.asarray(series["held"]) / usable
    ax2.fill_between(
        clock, used, color="#aaccee", step="post", label="blocks holding KV\n(held + cached)"
    )
    same = bool(np.array_equal(series["used"], series["held"]))
    note = "\n(= blocks holding KV: none cached unheld)" if same else ""
    ax2.step(
        clock,
        held,
        where="post",
        color="#aa3377",
        linestyle="--",
        lw=1.2,
        label=f"blocks held by requests\nand sessions{note}",
    )
    ax2.set(xlabel="simulated time (s)", ylabel=f"% of {usable + 1:,} blocks", ylim=(0, 105))
    ax2.legend(**_OUTSIDE)
    return fig


# ----------------------------------------------------------------------- queue.png


def _buckets(
    clock: np.ndarray, values: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Edges of ``n`` equal time buckets and each bucket's min, mean and max of ``values``
    (NaN where a bucket holds no step)."""
    start, end = float(clock[0]), float(clock[-1])
    edges = np.linspace(start, max(end, start + 1e-9), n + 1)
    which = np.minimum(((clock - start) / (edges[1] - start)).astype(np.int64), n - 1)
    v = np.asarray(values, dtype=np.float64)
    count = np.bincount(which, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(which, weights=v, minlength=n) / count
    lo = np.full(n, np.inf)
    np.minimum.at(lo, which, v)
    hi = np.full(n, -np.inf)
    np.maximum.at(hi, which, v)
    empty = count == 0
    lo[empty] = hi[empty] = np.nan
    return edges, lo, mean, hi


def queue_figure(series: dict[str, np.ndarray], title: str, buckets: int = QUEUE_BUCKETS) -> Any:
    """Running and waiting requests over time: each step when there are at most ``buckets``
    steps, else per time bucket the mean (line) and min-max range (band)."""
    plt = pyplot()
    clock = np.asarray(series["clock"], dtype=np.float64)
    fig, ax = plt.subplots(figsize=(12, 4), layout="constrained")
    what = "per step"
    for name, colour in (("running", "#4477aa"), ("waiting", "#cc3311")):
        values = np.asarray(series[name])
        if len(clock) <= buckets:
            ax.step(clock, values, where="post", color=colour, label=name, lw=1.0)
            continue
        edges, lo, mean, hi = _buckets(clock, values, buckets)
        mid = (edges[:-1] + edges[1:]) / 2
        ax.fill_between(mid, lo, hi, color=colour, alpha=0.25, lw=0, label=f"{name}: min-max")
        ax.plot(mid, mean, color=colour, lw=1.2, label=f"{name}: mean")
        what = f"per {edges[1] - edges[0]:,.2f} s bucket ({len(clock):,} steps)"
    ax.set(xlabel="simulated time (s)", ylabel="requests", title=f"{title}: queue length {what}")
    ax.set_ylim(bottom=0)
    ax.legend(**_OUTSIDE)
    return fig


# ----------------------------------------------------------------------- sweep.png


def write_sweep(
    out_dir: str | Path, key: str, values: Sequence[int], runs: Sequence[dict[str, Any]], title: str
) -> list[Path]:
    """sweep.json, sweep.md (``sweep_table.sweep_markdown``) and sweep.png: hit rate, TTFT
    p50 and TTFT p99 against the swept points, one line per checkpoint policy when policies
    are compared."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", {"key": key, "values": list(values), "runs": list(runs)})
    (out / SWEEP_TABLE).write_text(sweep_markdown(title, key, values, runs))
    plt = pyplot()
    fig = sweep_figure(key, values, runs, title)
    fig.savefig(out / SWEEP_PLOT, dpi=DPI)
    plt.close(fig)
    return [out / "sweep.json", out / SWEEP_TABLE, out / SWEEP_PLOT]


POLICY_COLOURS = ("#228833", "#4477aa", "#cc3311", "#aa3377", "#ccbb44", "#66ccee")
_MARKERS = ("o", "s", "^", "D", "v", "P")
_LINES = ("-", "--", "-.", ":")


def sweep_labels(key: str, values: Sequence[int], runs: Sequence[dict[str, Any]]) -> list[str]:
    """The x tick labels of sweep.png: the swept points as given (sizes in GiB, the
    unbounded budget as "unbounded"; ``KEY=`` in front under several keys), and under a
    checkpoint budget the state memory it allows (when every policy has the same)."""
    if not key:
        return ["as configured"]
    labels = []
    for point in sweep_points(key, values, runs):
        k, v = point
        text = point_label(k, v)
        if "+" in key:
            text = f"{'budget' if k == 'checkpoint-budget' else k.split('-')[-1]}\n{text}"
        here = runs_at(key, point, runs)
        memory = {m.get("state_memory_bytes", -1) for m in here}
        hybrid = all(m.get("hybrid") for m in here)
        bounded = v != UNBOUNDED_BUDGET
        if k == "checkpoint-budget" and hybrid and len(memory) == 1 and -1 not in memory:
            text += f"\n({gib(float(memory.pop()))})" if bounded else ""
        labels.append(text)
    return labels


def _hit_pct(m: dict[str, Any]) -> float:
    return 100 * float(m["token_hit_rate"])


def _p50_ms(m: dict[str, Any]) -> float:
    return 1000 * float(m["ttft_p50_s"])


def _p99_ms(m: dict[str, Any]) -> float:
    return 1000 * float(m["ttft_p99_s"])


def sweep_figure(
    key: str, values: Sequence[int], runs: Sequence[dict[str, Any]], title: str
) -> Any:
    """Three panels against the swept values (evenly spaced, in the order given): token hit
    rate, TTFT p50 and TTFT p99 (ms), each from 0 to its data's peak; one line per checkpoint
    policy, each with its own colour, marker and dash, nudged sideways so that equal lines
    stay visible; one legend below the panels."""
    plt = pyplot()
    policies = list(dict.fromkeys(m.get("checkpoint_policy", "") for m in runs))
    points = sweep_points(key, values, runs) if key else [("", 0)]
    # 13 inches holds 4 ticks a panel; each tick past 4 adds 0.9 inch a panel (3 panels)
    fig, axes = plt.subplots(1, 3, figsize=(13 + 2.7 * max(0, len(points) - 4), 4.6))
    pos = {p: i for i, p in enumerate(points)}
    several = "+" in key
    panels = (
        (_hit_pct, "token hit rate (%)"),
        (_p50_ms, "TTFT p50 (ms)"),
        (_p99_ms, "TTFT p99 (ms)"),
    )
    nudge = 0.06 if len(policies) > 1 else 0.0
    for i, policy in enumerate(policies):
        mine = [m for m in runs if m.get("checkpoint_policy", "") == policy]
        x = [
            pos.get((m.get("sweep_key", "") if several else key, m.get("sweep_value", 0)), 0)
            + (i - (len(policies) - 1) / 2) * nudge
            for m in mine
        ]
        style = {
            "color": POLICY_COLOURS[i % len(POLICY_COLOURS)],
            "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _LINES[i % len(_LINES)],
            "label": policy or "replay",
        }
        keys = [m.get("sweep_key", "") if several else key for m in mine]
        for ax, (get, _label) in zip(axes, panels, strict=True):
            for n, group in enumerate(dict.fromkeys(keys)):  # no line from one key to the next
                at = [j for j, k in enumerate(keys) if k == group]
                label = style["label"] if n == 0 else "_nolegend_"
                ax.plot([x[j] for j in at], [get(mine[j]) for j in at], **{**style, "label": label})
    for j in range(1, len(points)):
        if points[j][0] != points[j - 1][0]:  # a dashed rule between the keys of a sweep
            for ax in axes:
                ax.axvline(j - 0.5, color="#999999", linestyle="--", linewidth=0.8)
    hits = [100 * m["token_hit_rate"] for m in runs]
    ideal = runs[0].get("ideal_hit_rate") if runs else None
    if ideal is not None:
        axes[0].axhline(
            100 * ideal,
            color="#555555",
            linestyle=":",
            label=f"unbounded ideal: sequential, infinite cache ({100 * ideal:.1f} %)",
        )
        hits.append(100 * ideal)
    labels = sweep_labels(key, values, runs)
    for ax, (get, ylabel) in zip(axes, panels, strict=True):
        top = _pct_top(hits) if ax is axes[0] else _top([get(m) for m in runs])
        ax.set(ylabel=ylabel, ylim=(0, top), xlim=(-0.5, len(points) - 0.5))
        ax.set_xticks(range(len(points)), labels)
        ax.set_xlabel(axis_label(key))
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 5), frameon=False)
    swept = f": sweep of {key}" if key else ""
    lines = "routes" if runs and "route" in runs[0] else "checkpoint policies"  # (a cluster's)
    side = f", {lines} side by side" if policies != [""] else ""
    fig.suptitle(f"{title}{swept}{side}")
    rows = -(-len(names) // 5)
    fig.tight_layout(rect=(0, 0.04 + 0.05 * rows, 1, 1))
    return fig
