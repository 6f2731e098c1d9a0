"""PNG plots of bench/serve.py results (matplotlib, from the `bench` extra): latency CDFs, and
throughput and p99 latencies against request rate."""
from __future__ import annotations

from pathlib import Path

from bench.serve_metrics import RequestResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_latency_cdfs(runs: dict[str, list[RequestResult]], path: Path, title: str = "") -> Path:
    """One panel per metric (TTFT, TPOT, ITL, E2E), one line per run label."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    getters = {"TTFT": lambda r: [r.ttft], "TPOT": lambda r: [r.tpot] if r.tpot is not None else [],
               "ITL": lambda r: r.itl, "E2E": lambda r: [r.e2e]}
    for ax, (name, get) in zip(axes, getters.items()):
        for label, results in runs.items():
            values = [v * 1000 for r in results if r.success for v in get(r)]
            if values:
                ax.plot(*_cdf(values), label=label)
        ax.set_xlabel(f"{name} (ms)")
        if name == "ITL":  # a stall is 10-100x the median gap: only a log axis shows both
            ax.set_xscale("log")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_rate_sweep(series: dict[str, list[tuple[float, dict]]], path: Path, title: str = "") -> Path:
    """Request throughput and p99 TTFT / ITL against the offered rate, one line per server label."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("request_throughput", None, "completed req/s"), ("ttft_ms", "p99", "TTFT p99 (ms)"),
              ("itl_ms", "p99", "ITL p99 (ms)"))
    for ax, (key, stat, label) in zip(axes, panels):
        for name, points in series.items():
            points = sorted(points, key=lambda p: p[0])
            ys = [s[key][stat] if stat else s[key] for _, s in points]
            ax.plot([rate for rate, _ in points], ys, marker="o", label=name)
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(title or "against request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
