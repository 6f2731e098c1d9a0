"""bench/compare.py case a's workloads and figures: the three mixes tandem and vLLM serve, the per-rate
comparison (goodput, ratios tandem ÷ vLLM) and where each side's first token spends its time. Pure functions.

Mixes (serve.py arguments; every run draws fresh prompts from its own seed, so neither server's prefix
cache sees a previous run's prompts):
  random  256-token prompts, 64 tokens out (the issue's case a);
  long    prompts uniform in 1024..4096 tokens, 26..103 out (one range ratio for both, as vLLM's);
  prefix  4 shared 1536-token prefixes, each with its own 64-token suffixes, 64 out.
"""
from __future__ import annotations

import math

from bench.serve_client import VLLM_PHASE_HISTOGRAMS
from bench.serve_metrics import percentile

MIXES = {
    "random": ["--dataset", "random", "--random-input-len", "256", "--random-output-len", "64"],
    "long": ["--dataset", "random", "--random-input-len", "2560", "--random-range-ratio", "0.6",
             "--random-output-len", "64"],
    "prefix": ["--dataset", "prefix-repetition", "--prefix-num-prefixes", "4", "--prefix-len", "1536",
               "--prefix-suffix-len", "64", "--prefix-output-len", "64"],
}
# Per mix: one rate below both servers' capacity on 2 cores and ones past it (bench/HISTORY.md, issue 38).
DEFAULT_RATES = {"random": [1.0, 3.0], "long": [0.1, 0.3], "prefix": [0.15, 1.0]}

# tandem's stages (engine/timeline.py) grouped into the phases of its first token; a gap between two
# consecutive stages a request passed counts towards the phase of the later one. "routing" includes the
# router's wait for a prefill slot (RequestRouter._route) while the prefill queue is full.
PHASES = {"validation": ("validated",), "tokenization": ("tokenized",), "routing": ("routed",),
          "queue": ("prefill_queued", "prefill_started"), "prefill": ("prefill_done",),
          "transfer": ("transfer_started", "transfer_done"), "decode admission": ("decode_admitted", "decode_started"),
          "first token out": ("first_token",)}
_PHASE_OF = {stage: phase for phase, stages in PHASES.items() for stage in stages}



def phase_ms(timeline: dict) -> dict[str, float]:
    """One request's milliseconds per phase up to its first token, from its stage times. A prefill on the
    decode worker (local) stamps no prefill_done: its first token ends the prefill."""
    times = timeline.get("times", {})
    passed = sorted(((s, t) for s, t in times.items() if s == "arrival" or s in _PHASE_OF), key=lambda st: st[1])
    local = "prefill_done" not in times and "prefill_started" in times
    out: dict[str, float] = {}
    for (_, before), (stage, at) in zip(passed, passed[1:]):
        phase = "prefill" if local and stage == "first_token" else _PHASE_OF[stage]
        out[phase] = out.get(phase, 0.0) + (at - before) * 1000
    return out


def stage_breakdown(requests: list[dict]) -> dict:
    """p50 ms of each phase over the traced requests of one run, overall and per prefill path
    (local: on the decode worker, remote: on a prefill worker), with each path's share; `client` is the
    client's TTFT less the server's arrival → first token (HTTP and the Serve proxy)."""
    traced = [r for r in requests if r.get("success") and r.get("timeline")]
    if not traced:
        return {}
    groups = {"all": traced}
    for r in traced:
        groups.setdefault(r["timeline"].get("prefill_path") or "?", []).append(r)
    out = {"n": len(traced), "share": {p: len(rs) / len(traced) for p, rs in groups.items() if p != "all"}}
    for path, rs in groups.items():
        phases = [phase_ms(r["timeline"]) for r in rs]
        row = {p: percentile([ph[p] for ph in phases if p in ph], 50) for p in PHASES
               if any(p in ph for ph in phases)}
        row["client"] = percentile([r["ttft"] * 1000 - sum(ph.values()) for r, ph in zip(rs, phases)], 50)
        row["TTFT"] = percentile([r["ttft"] * 1000 for r in rs], 50)
        row.update(prefill_work(rs))
        out[path] = row
    return out


def prefill_work(requests: list[dict], block_size: int = 16) -> dict[str, float]:
    """What the prefills computed: p50 forward seconds → ms, p50 prompt tokens computed per forward second
    (the prompt less the blocks the prefilling worker had cached), and the share of requests with a cache hit
    there (tandem's timeline: prefill_forward_s, prefill_overlap_blocks on a remote prefill,
    decode_overlap_blocks on a local one)."""
    forward, rate, hits = [], [], 0
    for r in requests:
        tl = r["timeline"]
        cached = (tl.get("prefill_overlap_blocks") if tl.get("prefill_path") == "remote"
                  else tl.get("decode_overlap_blocks")) or 0
        hits += cached > 0
        if tl.get("prefill_forward_s"):
            forward.append(tl["prefill_forward_s"] * 1000)
            rate.append(max(0, r["prompt_len"] - cached * block_size) / tl["prefill_forward_s"])
    return {"forward_ms": percentile(forward, 50), "tok_per_s": percentile(rate, 50), "hit_share": hits / len(requests)}


def vllm_breakdown(series_deltas: dict[str, float]) -> dict[str, float]:
    """Mean ms per request of each of vLLM's phases over a run, from its histograms' _sum/_count increases."""
    totals: dict[str, float] = {}
    for series, value in series_deltas.items():
        name = series.split("{", 1)[0]
        totals[name] = totals.get(name, 0.0) + value
    out = {}
    for phase, name in VLLM_PHASE_HISTOGRAMS.items():
        count = totals.get(f"{name}_count", 0.0)
        if count:
            out[phase] = totals.get(f"{name}_sum", 0.0) / count * 1000
    return out


def goodput(summary: dict) -> tuple[float, float]:
    """(requests per second meeting every SLO, the fraction of requests that did)."""
    return summary.get("goodput", math.nan), summary.get("slo_attainment", math.nan)


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _ms(v: float) -> str:
    return "–" if v is None or math.isnan(v) else (f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms")


def comparison_rows(mix: str, tandem_runs: list[dict], vllm_runs: list[dict]) -> list[str]:
    """Markdown rows, per rate: each side's figures and then the ratio tandem ÷ vLLM."""
    rows = []
    by_rate = {r["request_rate"]: r for r in vllm_runs}
    for t in tandem_runs:
        v = by_rate.get(t["request_rate"])
        for name, run in (("tandem", t), ("vLLM", v)):
            if run:
                rows.append(_row(mix, name, run["request_rate"], run["summary"]))
        if v:
            rows.append(_ratio_row(mix, t["request_rate"], t["summary"], v["summary"]))
    return rows


def _row(mix: str, name: str, rate: float, s: dict) -> str:
    good, frac = goodput(s)
    return (f"| {mix} | {rate:g} | {name} | {s['request_throughput']:.2f} | {_ms(s['ttft_ms']['median'])} / "
            f"{_ms(s['ttft_ms']['p99'])} | {_ms(s['itl_ms']['p99'])} | {_ms(s['tpot_ms']['median'])} | "
            f"{good:.2f} ({frac:.0%}) | {s['completed']} / {s['failed']} |")


def _ratio_row(mix: str, rate: float, t: dict, v: dict) -> str:
    def r(key, stat):
        return f"{ratio(t[key][stat], v[key][stat]):.2f}×"
    return (f"| {mix} | {rate:g} | **÷** | {ratio(t['request_throughput'], v['request_throughput']):.2f}× | "
            f"{r('ttft_ms', 'median')} / {r('ttft_ms', 'p99')} | {r('itl_ms', 'p99')} | {r('tpot_ms', 'median')} | "
            f"{ratio(goodput(t)[0], goodput(v)[0]):.2f}× | |")


TABLE_HEAD = ["| mix | rate | server | req/s | TTFT p50 / p99 | ITL p99 | TPOT p50 | goodput req/s (share) "
              "| completed / lost |", "|---|---|---|---|---|---|---|---|---|"]


def breakdown_rows(mix: str, rate: float, tandem_run: dict | None, vllm_run: dict | None) -> list[str]:
    """Markdown rows: tandem's p50 per phase (all requests, then per prefill path) and vLLM's means."""
    rows = []
    b = stage_breakdown(tandem_run["requests"]) if tandem_run else {}
    for path in ("all", "remote", "local"):
        if path in b:
            share = "" if path == "all" else f" {b['share'][path]:.0%}"
            row = b[path]
            cells = " | ".join(_ms(row.get(p)) if p in row else "–" for p in (*PHASES, "client", "TTFT"))
            rows.append(f"| {mix} | {rate:g} | tandem {path}{share} | {cells} | {_ms(row['forward_ms'])}, "
                        f"{row['tok_per_s']:.0f} tok/s, {row['hit_share']:.0%} hits |")
    if vllm_run:
        v = vllm_breakdown(vllm_run["server_counters"].get("series", {}))
        if v:  # its histograms give means; `client` holds its server-side TTFT mean, TTFT the client's p50
            rows.append(f"| {mix} | {rate:g} | vLLM (means) | – | – | – | {_ms(v.get('queue'))} | "
                        f"{_ms(v.get('prefill'))} | – | – | – | server TTFT {_ms(v.get('TTFT'))} | "
                        f"{_ms(vllm_run['summary']['ttft_ms']['median'])} | {_vllm_hits(vllm_run)} |")
    return rows


def _vllm_hits(run: dict) -> str:
    hit = run["server_counters"].get("prefix_hit_rate")
    return "–" if hit is None else f"{hit:.0%} of prompt tokens hit"


BREAKDOWN_HEAD = ["| mix | rate | server, prefill path (share) | " + " | ".join(PHASES) + " | client | TTFT "
                  "| prefill forward p50, computed tok/s, cache hits |",
                  "|---|---|---|" + "---|" * (len(PHASES) + 3)]
