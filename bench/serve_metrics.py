"""bench/serve.py's measurements: per-request timings in, the summary `vllm bench serve` prints out.

Definitions (DESIGN.md §4): TTFT = arrival (the moment the client sends) to the first token;
E2E = arrival to the last token; TPOT = (E2E − TTFT) / (output tokens − 1), for requests with more
than one token; ITL = the gaps between successive chunks that carry tokens. Goodput counts the
requests that meet every SLO given (`ttft`, `tpot`, `e2e`, in ms) per second of the run.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestResult:
    kind: str
    prompt_len: int
    expected_output_len: int
    arrival: float = 0.0  # seconds since the run began, as sent
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finish_reason: str | None = None
    # tandem's stage timeline of the request (--tandem-trace): stage times and the routing decision.
    timeline: dict | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 (and the count) of values given in seconds, in milliseconds."""
    ms = [v * 1000 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan, "median": percentile(ms, 50)}
    out.update({f"p{p}": percentile(ms, p) for p in PERCENTILES if p != 50})
    out["count"] = len(ms)
    return out


def parse_slos(specs: list[str] | None) -> dict[str, float]:
    """`["ttft:2000", "tpot:250"]` → {"ttft": 2000.0, "tpot": 250.0} (milliseconds)."""
    slos = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be positive")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2e": r.e2e}
    return all(values[name] * 1000 <= limit for name, limit in slos.items())


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """The run's figures: counts, throughput, goodput and latency distributions (ms)."""
    ok = [r for r in results if r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in ok]),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        summary["slos_ms"] = dict(slos)
        summary["goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(results) if results else math.nan
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    summary["errors"] = errors
    return summary


def summarize_by_kind(results: list[RequestResult], duration_s: float,
                      slos: dict[str, float] | None = None) -> dict[str, dict]:
    """One summary per request kind, when a dataset has more than one (short/long, prefix-N, ...)."""
    kinds = sorted({r.kind for r in results})
    if len(kinds) < 2:
        return {}
    return {k: summarize([r for r in results if r.kind == k], duration_s, slos) for k in kinds}


def max_rate_meeting_slos(sweep: list[tuple[float, dict]], attainment: float = 0.9) -> float | None:
    """DistServe's goodput over a rate sweep: the highest rate at which at least `attainment` of the
    requests met every SLO (and every rate below it did too); None if even the lowest missed."""
    best = None
    for rate, summary in sorted(sweep, key=lambda item: item[0]):
        if summary.get("slo_attainment", 0.0) < attainment:
            break
        best = rate
    return best


def format_summary(summary: dict, title: str) -> str:
    """A plain-text block like `vllm bench serve`'s."""
    lines = [f"{'=' * 20} {title} {'=' * 20}",
             f"{'Successful requests:':<40}{summary['completed']:>10}",
             f"{'Failed requests:':<40}{summary['failed']:>10}",
             f"{'Benchmark duration (s):':<40}{summary['duration_s']:>10.2f}",
             f"{'Total input tokens:':<40}{summary['total_input_tokens']:>10}",
             f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>10}",
             f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>10.2f}",
             f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>10.2f}"]
    if "goodput" in summary:
        lines.append(f"{'Request goodput (req/s):':<40}{summary['goodput']:>10.2f}")
        lines.append(f"{'SLO attainment:':<40}{summary['slo_attainment']:>10.1%}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = summary[f"{name}_ms"]
        for stat in ("mean", "median", "p90", "p99"):
            label = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {name.upper()} (ms):"
            lines.append(f"{label:<40}{d[stat]:>10.2f}")
    for error, count in summary["errors"].items():
        lines.append(f"failed ({count}): {error}")
    return "\n".join(lines)


# tandem's stages up to the first token, in order (engine/timeline.py STAGES).
TTFT_STAGES = ("arrival", "validated", "tokenized", "routed", "peer_pull_started", "peer_pull_done", "prefill_queued",
               "prefill_started", "prefill_done", "transfer_started", "transfer_done", "decode_admitted", "decode_started", "first_token")


def stage_gaps(timeline: dict) -> dict[str, float]:
    """Milliseconds between consecutive stages of a timeline up to its first token, keyed by the later stage."""
    times = timeline.get("times", {})
    passed = sorted(((stage, times[stage]) for stage in TTFT_STAGES if stage in times), key=lambda item: item[1])
    return {stage: round((at - before) * 1000, 1) for (_, before), (stage, at) in zip(passed, passed[1:])}


def slowest_ttfts(results: list[RequestResult], count: int = 5) -> list[dict]:
    """The `count` slowest first tokens among requests that carry tandem's timeline (--tandem-trace): each
    with the routing decision and the milliseconds between consecutive stages it passed up to its first
    token, so a tail can be pinned on a stage (a prefill queue, a local prefill, a pull)."""
    traced = sorted((r for r in results if r.success and r.timeline), key=lambda r: r.ttft, reverse=True)
    out = []
    for r in traced[:count]:
        gaps = stage_gaps(r.timeline)
        out.append({"ttft_ms": round(r.ttft * 1000, 1), "arrival_s": round(r.arrival, 2),
                    "path": r.timeline.get("prefill_path"), "reason": r.timeline.get("routing_reason"),
                    "predicted_ttft_ms": None if r.timeline.get("predicted_ttft_s") is None
                    else round(r.timeline["predicted_ttft_s"] * 1000, 1), "gaps_ms": gaps,
                    "prefill_steps": r.timeline.get("prefill_steps", 0),
                    "prefill_borrowed_steps": r.timeline.get("prefill_borrowed_steps", 0),
                    "prefill_forward_ms": round(r.timeline.get("prefill_forward_s", 0.0) * 1000, 1)})
    return out


def format_slowest(rows: list[dict]) -> str:
    """One line per slow request: TTFT, path, reason, prediction, then `stage +ms` for each gap."""
    lines = []
    for row in rows:
        gaps = " ".join(f"{stage} +{ms:g}" for stage, ms in row["gaps_ms"].items())
        steps = ""
        if row.get("prefill_steps"):
            steps = (f" | prefill in {row['prefill_steps']} forwards ({row['prefill_borrowed_steps']} borrowed), "
                     f"{row['prefill_forward_ms']:g} ms")
        lines.append(f"TTFT {row['ttft_ms']:g} ms at {row['arrival_s']:g} s: {row['path']} ({row['reason']}, "
                     f"predicted {row['predicted_ttft_ms']} ms) | {gaps}{steps}")
    return "\n".join(lines)
