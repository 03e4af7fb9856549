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

PLOTS = ("ttft.png", "cache.png", "queue.png")
SWEEP_PLOT = "sweep.png"


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
        ("evictions", f"{m['evictions']:,} blocks"),
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
    swept), hit rate, TTFT and evictions."""
    policies = any(m.get("checkpoint_policy") for m in runs)
    head = f"  {'policy':<11}" if policies else ""
    head += f"{key:>20}" if key else ""
    head += f"  {'hit rate':>9}  {'TTFT p50':>10}  {'TTFT p99':>10}  {'evictions':>10}"
    lines = [head]
    for m in runs:
        line = f"  {m.get('checkpoint_policy', ''):<11}" if policies else ""
        line += f"{m['sweep_value']:>20,}" if key else ""
        line += (
            f"  {_pct(m['token_hit_rate']):>9}  {_ms(m['ttft_p50_s']):>10}"
            f"  {_ms(m['ttft_p99_s']):>10}  {m['evictions']:>10,}"
        )
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------- files


def _pyplot() -> Any:
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
    plt = _pyplot()
    clock = np.asarray(series["clock"], dtype=np.float64)
    usable = max(int(metrics["cache_blocks"]) - 1, 1)
    files = [out / "metrics.json", out / "timeseries.json"]

    # TTFT distribution: histogram (log-spaced) and CDF, with the percentiles marked.
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if len(ttft):
        lo = max(float(ttft.min()), 1e-4)
        hi = max(float(ttft.max()), lo * 10)
        ax1.hist(ttft, bins=np.geomspace(lo, hi, 50), color="#4477aa")
        ax1.set_xscale("log")
        xs = np.sort(ttft)
        ax2.plot(xs, np.arange(1, len(xs) + 1) / len(xs), color="#4477aa")
        ax2.set_xscale("log")
        for q, style in ((50, "-"), (90, "--"), (99, ":")):
            v = float(np.percentile(ttft, q))
            for ax in (ax1, ax2):
                ax.axvline(v, color="#cc3311", linestyle=style, label=f"p{q} {1000 * v:,.0f} ms")
    ax1.set(xlabel="TTFT (s)", ylabel="requests", title="TTFT histogram")
    ax2.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax1.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / PLOTS[0], dpi=100)
    plt.close(fig)

    # Hit rate and cache use over time (two panels sharing the time axis).
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    span = float(clock[-1]) if len(clock) else 1.0
    edges = np.linspace(0.0, max(span, 1e-9), 51)
    hit = _windows(clock, series["hit_tokens"], edges)
    query = _windows(clock, series["query_tokens"], edges)
    with np.errstate(invalid="ignore", divide="ignore"):
        window = np.where(query > 0, hit / query, np.nan)
    cum_q = np.cumsum(series["query_tokens"])
    cum_h = np.cumsum(series["hit_tokens"])
    with np.errstate(invalid="ignore", divide="ignore"):
        cumulative = np.where(cum_q > 0, cum_h / np.maximum(cum_q, 1), np.nan)
    width = edges[1] - edges[0]
    ax1.bar(
        edges[:-1],
        100 * np.nan_to_num(window),
        width=width,
        align="edge",
        color="#88ccaa",
        edgecolor="white",
        label=f"per {width:,.1f} s window",
    )
    ax1.plot(clock, 100 * cumulative, color="#117733", label="cumulative")
    if metrics.get("ideal_hit_rate") is not None:
        ax1.axhline(
            100 * metrics["ideal_hit_rate"],
            color="#117733",
            linestyle=":",
            label="sequential ideal (infinite cache)",
        )
    ax1.set(ylabel="token hit rate (%)", ylim=(0, 105))
    ax1.set_title(f"{title}: prefix hit rate and cache use")
    ax1.legend(loc="upper left", fontsize="small")
    ax2.plot(clock, 100 * series["used"] / usable, color="#4477aa", label="blocks holding KV")
    ax2.plot(clock, 100 * series["held"] / usable, color="#cc6677", label="blocks held by requests")
    ax2.set(xlabel="simulated time (s)", ylabel=f"% of {usable + 1:,} blocks", ylim=(0, 105))
    ax2.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(out / PLOTS[1], dpi=100)
    plt.close(fig)

    # Queue length over time.
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.step(clock, series["running"], where="post", color="#4477aa", label="running", lw=0.8)
    ax.step(clock, series["waiting"], where="post", color="#cc3311", label="waiting", lw=0.8)
    ax.set(xlabel="simulated time (s)", ylabel="requests", title=f"{title}: queue length")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out / PLOTS[2], dpi=100)
    plt.close(fig)
    return [*files, *(out / p for p in PLOTS)]


def write_sweep(
    out_dir: str | Path, key: str, values: Sequence[int], runs: Sequence[dict[str, Any]], title: str
) -> list[Path]:
    """sweep.json and sweep.png: hit rate and TTFT against the swept value; with several
    checkpoint policies, one line per policy against the state memory each run had."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", {"key": key, "values": list(values), "runs": list(runs)})
    policies = list(dict.fromkeys(m.get("checkpoint_policy", "") for m in runs))
    if len(policies) > 1 or policies[0]:
        _plot_policies(out, key, runs, policies, title)
    else:
        _plot_sweep(out, key, values, runs, title)
    return [out / "sweep.json", out / SWEEP_PLOT]


def _plot_sweep(
    out: Path, key: str, values: Sequence[int], runs: Sequence[dict[str, Any]], title: str
) -> None:
    plt = _pyplot()
    fig, ax1 = plt.subplots(figsize=(8, 4.5))
    hit = [100 * m["token_hit_rate"] for m in runs]
    ax1.plot(values, hit, "o-", color="#228833", label="token hit rate")
    _ideal_line(ax1, runs)
    ax1.set(xlabel=key, ylabel="token hit rate (%)", ylim=(0, 100))
    ax1.set_xscale("log", base=2)
    ax2 = ax1.twinx()
    for q, style in ((50, "s-"), (99, "^--")):
        ax2.plot(
            values, [m[f"ttft_p{q}_s"] for m in runs], style, color="#cc3311", label=f"TTFT p{q}"
        )
    ax2.set_ylabel("TTFT (s)")
    ax2.set_yscale("log")
    lines = ax1.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax1.legend(lines[0] + more[0], lines[1] + more[1], loc="center right")
    ax1.set_title(f"{title}: sweep of {key}")
    fig.tight_layout()
    fig.savefig(out / SWEEP_PLOT, dpi=100)
    plt.close(fig)


def _ideal_line(ax: Any, runs: Sequence[dict[str, Any]]) -> None:
    if runs and runs[0].get("ideal_hit_rate") is not None:
        ax.axhline(
            100 * runs[0]["ideal_hit_rate"],
            color="#228833",
            linestyle=":",
            label="sequential ideal (infinite cache)",
        )


_POLICY_COLOURS = ("#228833", "#4477aa", "#cc3311", "#aa3377", "#ccbb44", "#66ccee")


def _plot_policies(
    out: Path, key: str, runs: Sequence[dict[str, Any]], policies: list[str], title: str
) -> None:
    """Two panels, one line per policy: token hit rate and TTFT p50 (p99 dashed) against
    the state memory of the checkpoint budget (GiB)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, policy in enumerate(policies):
        mine = [m for m in runs if m.get("checkpoint_policy", "") == policy]
        x = [m["state_memory_bytes"] / (1 << 30) for m in mine]
        colour = _POLICY_COLOURS[i % len(_POLICY_COLOURS)]
        name = policy or "config"
        ax1.plot(x, [100 * m["token_hit_rate"] for m in mine], "o-", color=colour, label=name)
        ax2.plot(x, [m["ttft_p50_s"] for m in mine], "s-", color=colour, label=f"{name} p50")
        ax2.plot(x, [m["ttft_p99_s"] for m in mine], "^--", color=colour, alpha=0.6)
    _ideal_line(ax1, runs)
    ax1.set(xlabel="checkpoint state memory (GiB)", ylabel="token hit rate (%)", ylim=(0, 100))
    ax2.set(xlabel="checkpoint state memory (GiB)", ylabel="TTFT (s): p50 solid, p99 dashed")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax1.legend(loc="lower right")
    ax2.legend(loc="upper right")
    swept = f", sweep of {key}" if key else ""
    fig.suptitle(f"{title}: checkpoint policies side by side{swept}")
    fig.tight_layout()
    fig.savefig(out / SWEEP_PLOT, dpi=100)
    plt.close(fig)
