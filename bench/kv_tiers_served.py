"""A prefix-heavy serving workload that no worker's cache holds, through `tandem serve` (issue 41, the served
measurement): KV tiers and peer prefix pulls on against off, and against vLLM's CPU build with its prefix cache
at the same total KV memory, one fresh server at a time in one run.

Workload (bench/serve_data.prefix_zipf_sessions): `--prefixes` system prompts of `--prefix-len` tokens (uniform
in the range), picked with Zipf popularity (`--zipf`), each with a fresh `--question-len`-token question,
`--output-len` tokens out, `--requests` at `--rate` req/s (Poisson), sent by bench/serve.py's client (vLLM's
`bench serve` semantics) as token ids to /v1/completions. Before the measured run every server sees each prefix
once (least popular first), as a deployment's steady state has: the prefixes' KV is ~4x the KV memory.

Arms (same dtype, pinned):
  tiers  tandem, 2 colocated decode workers, `--kv-mem-gb` of KV cache each (a quarter of the prefixes each),
         a host tier of `--host-gb` each, peer prefix pulls on (the default)
  none   the same without the host tier and with peer pulls off
  vllm   vLLM's CPU build at its own defaults (compiled, prefix caching on), KV memory = both workers' together
Reported per arm: prompt tokens computed per request (prompt tokens - prefix-cache hit tokens, from the servers'
own vllm:prefix_cache_* counters), TTFT p50/p99, ITL p50/p99, and for tandem the hits per tier and the blocks
pulled from peers; then the ratios tiers/none and tiers/vllm.

Run: .venv/bin/python bench/kv_tiers_served.py                       (~15 min on 2 cores)
     .venv/bin/python bench/kv_tiers_served.py --arms tiers,none --requests 32     (quicker, no vLLM)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import serve, serve_client, serve_data  # noqa: E402
from bench.compare import ROOT, ServerSpec, running, tandem  # noqa: E402
from bench.serve_metrics import parse_slos, slowest_ttfts, summarize, format_slowest, stage_gaps  # noqa: E402

SLOS = ["ttft:2000", "tpot:250"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="tiers,none,vllm")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefixes", type=int, default=64)
    p.add_argument("--prefix-len", type=int, nargs=2, default=(1024, 2048), metavar=("MIN", "MAX"))
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--kv-mem-gb", type=float, default=0.5, help="KV cache per tandem worker (GiB); vLLM gets 2x")
    p.add_argument("--host-gb", type=float, default=2.5, help="host tier per tandem worker (GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="tandem arms: each request's stage timeline "
                   "(X-Tandem-Trace: 1); reports the median milliseconds between stages and the slowest requests")
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench/results/<time>)")
    return p.parse_args(argv)


def specs(args, out: Path) -> dict[str, ServerSpec]:
    engine = f"engine: {{kv_cache_memory_gb: {args.kv_mem_gb}}}\n"
    configs = {"tiers": engine + f"kv_tiers: {{host_gb: {args.host_gb}}}\ntransfer: {{peer_prefix_pulls: true}}\n",
               "none": engine + "transfer: {peer_prefix_pulls: false}\n"}
    out_specs = {}
    for arm, text in configs.items():
        path = out / f"{arm}.yaml"
        path.write_text(text)
        out_specs[arm] = tandem(f"tandem-{arm}", "--colocated", "--decode", "2", "--dtype", args.dtype,
                                "--config", str(path))
        out_specs[arm].trace = False
    vllm_gib = max(1, round(2 * args.kv_mem_gb))
    out_specs["vllm"] = ServerSpec(f"vllm-cpu-{args.dtype}", ["env", f"VLLM_DTYPE={args.dtype}",
                                                              f"VLLM_CPU_KVCACHE_SPACE={vllm_gib}",
                                                              str(ROOT / "bench/vllm_peer.sh"), "serve", "{port}"])
    return out_specs


TIER_HITS = re.compile(r'^tandem:kv_tier_hits(?:_total)?\{([^}]*)\} ([0-9.eE+-]+)$')
PEER_BLOCKS = re.compile(r'^tandem:kv_peer_pull_blocks(?:_total)?\{[^}]*\} ([0-9.eE+-]+)$')
# Where the first token's time goes: tandem's stage histogram (engine/timeline.py's PHASES) and the two
# request-level histograms both servers export (vLLM's names).
TIMES = re.compile(r'^(tandem:request_stage_seconds|vllm:request_queue_time_seconds|'
                   r'vllm:request_prefill_time_seconds|vllm:time_to_first_token_seconds)_(sum|count)'
                   r'\{([^}]*)\} ([0-9.eE+-]+)$')


async def metrics_text(base_url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base_url}/metrics") as response:
            return await response.text()


async def time_sums(base_url: str) -> dict[str, list[float]]:
    """Seconds and counts per histogram (per stage for tandem's stage histogram), summed over workers."""
    text = await metrics_text(base_url)
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = TIMES.match(line)
        if m:
            stage = re.search(r'stage="([^"]+)"', m.group(3))
            key = m.group(1).split(":")[1] + (f".{stage.group(1)}" if stage else "")
            out.setdefault(key, [0.0, 0.0])[0 if m.group(2) == "sum" else 1] += float(m.group(4))
    return out


def median_gaps(results) -> dict[str, dict]:
    """Per stage up to the first token, the median milliseconds since the stage before it, over the requests
    that passed it (X-Tandem-Trace timelines), with how many passed."""
    gaps: dict[str, list[float]] = {}
    for r in results:
        if r.success and r.timeline:
            for stage, ms in stage_gaps(r.timeline).items():
                gaps.setdefault(stage, []).append(ms)
    return {stage: {"median_ms": round(statistics.median(v), 1), "requests": len(v)} for stage, v in gaps.items()}


def mean_ms(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, float]:
    """Mean milliseconds per observation in the measured window, per histogram."""
    out = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, [0.0, 0.0])
        if count > count0:
            out[key] = round(1000 * (total - total0) / (count - count0), 1)
    return out


async def tandem_counters(base_url: str) -> dict:
    """Hits per tier (blocks promoted back) and blocks pulled from peers, from tandem's /metrics."""
    text = await metrics_text(base_url)
    out = {"tier_hits": {}, "peer_blocks": 0.0}
    for line in text.splitlines():
        m = TIER_HITS.match(line)
        if m:
            tier = re.search(r'tier="([^"]+)"', m.group(1))
            if tier:
                out["tier_hits"][tier.group(1)] = out["tier_hits"].get(tier.group(1), 0.0) + float(m.group(2))
        m = PEER_BLOCKS.match(line)
        if m:
            out["peer_blocks"] += float(m.group(1))
    return out


async def measure(args, base_url: str, is_tandem: bool) -> dict:
    model = (await serve_client.fetch_models(base_url))[0]
    target = serve_client.Target(base_url, model, "/v1/completions", timeout_s=600.0,
                                 extra_headers={"X-Tandem-Trace": "1"} if is_tandem and args.trace else {})
    space = serve.load_token_space(None)
    common = (space, args.requests, args.prefixes, tuple(args.prefix_len), args.question_len, args.output_len,
              args.zipf, args.seed)
    warm = serve_data.prefix_zipf_sessions(*common, warm_up=True)
    started = time.monotonic()
    await serve_client.run_workload(target, warm, max_concurrency=2, show_progress=False)
    print(f"  warmed up with {len(warm)} prefixes in {time.monotonic() - started:.0f} s", flush=True)
    sessions = serve_data.prefix_zipf_sessions(*common)
    serve_data.assign_arrivals(sessions, args.rate, 1.0, args.seed)
    await asyncio.sleep(3.0)  # the warm-up's counts reach /metrics with the workers' next stats
    before = await serve_client.scrape_counters(base_url)
    tiers_before = await tandem_counters(base_url) if is_tandem else None
    times_before = await time_sums(base_url)
    results, duration = await serve_client.run_workload(target, sessions, show_progress=False)
    await asyncio.sleep(3.0)  # workers report their stats periodically
    counters = serve_client.counter_deltas(before, await serve_client.scrape_counters(base_url))
    stage_ms = mean_ms(times_before, await time_sums(base_url))
    run = {"summary": summarize(results, duration, parse_slos(SLOS)), "server_counters": counters,
           "prompt_tokens": sum(r.prompt_len for r in results if r.success), "stage_ms": stage_ms}
    totals = counters.get("totals", {})
    queries, hits = totals.get("vllm:prefix_cache_queries", 0.0), totals.get("vllm:prefix_cache_hits", 0.0)
    run["computed_per_request"] = (queries - hits) / max(1, len(results))
    if is_tandem and args.trace:
        run["stage_gaps_ms"] = median_gaps(results)
        run["slowest"] = slowest_ttfts(results)
    if is_tandem:
        after = await tandem_counters(base_url)
        run["tier_hit_blocks"] = {t: n - tiers_before["tier_hits"].get(t, 0.0) for t, n in after["tier_hits"].items()}
        run["peer_blocks"] = after["peer_blocks"] - tiers_before["peer_blocks"]
    return run


def main(argv=None) -> None:
    args = parse_args(argv)
    out = args.out or ROOT / "bench/results" / time.strftime("kv-tiers-served-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    all_specs = specs(args, out)
    runs = {}
    for arm in args.arms.split(","):
        spec = all_specs[arm]
        with running(spec, out) as base_url:
            runs[arm] = asyncio.run(measure(args, base_url, arm != "vllm"))
        s = runs[arm]["summary"]
        print(f"[{arm}] {s['completed']} done, {s['failed']} failed; computed/request "
              f"{runs[arm]['computed_per_request']:.0f} of {runs[arm]['prompt_tokens'] / max(1, s['completed']):.0f}; "
              f"TTFT p50/p99 {s['ttft_ms']['median']:.0f}/{s['ttft_ms']['p99']:.0f} ms; ITL p50/p99 "
              f"{s['itl_ms']['median']:.1f}/{s['itl_ms']['p99']:.1f} ms; tiers {runs[arm].get('tier_hit_blocks')}, "
              f"peer blocks {runs[arm].get('peer_blocks')}", flush=True)
    (out / "kv_tiers_served.json").write_text(json.dumps({"argv": sys.argv, "args": vars(args) | {"out": str(out)},
                                                          "runs": runs}, indent=1, default=str))
    report(runs)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(b) else "-"


def report(runs: dict) -> None:
    print("\n| arm | computed tokens/request | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |")
    print("|---|---|---|---|---|---|---|")
    for arm, run in runs.items():
        s = run["summary"]
        print(f"| {arm} | {run['computed_per_request']:.0f} | {s['ttft_ms']['median']:.0f} | {s['ttft_ms']['p99']:.0f} "
              f"| {s['itl_ms']['median']:.1f} | {s['itl_ms']['p99']:.1f} | {s['failed']} |")
    for base in ("none", "vllm"):
        if "tiers" in runs and base in runs:
            t, b = runs["tiers"], runs[base]
            ts, bs = t["summary"], b["summary"]
            print(f"tiers / {base}: computed {ratio(t['computed_per_request'], b['computed_per_request'])}, TTFT p50 "
                  f"{ratio(ts['ttft_ms']['median'], bs['ttft_ms']['median'])}, p99 "
                  f"{ratio(ts['ttft_ms']['p99'], bs['ttft_ms']['p99'])}, ITL p50 "
                  f"{ratio(ts['itl_ms']['median'], bs['itl_ms']['median'])}")
    print("\nmean ms per stage in the measured window (tandem: engine/timeline.py's phases; both: vLLM's histograms)")
    for arm, run in runs.items():
        print(f"  {arm}: " + ", ".join(f"{k} {v}" for k, v in sorted(run.get("stage_ms", {}).items())))
    for arm, run in runs.items():
        if "stage_gaps_ms" in run:
            print(f"\n{arm}: median ms from the stage before, per stage up to the first token (requests passing it): "
                  + ", ".join(f"{k} {v['median_ms']} ({v['requests']})" for k, v in run["stage_gaps_ms"].items()))
            print(format_slowest(run["slowest"]))


if __name__ == "__main__":
    main()
