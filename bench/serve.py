"""Load generator for any OpenAI-compatible server, in the spirit of `vllm bench serve`.

    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000 --dataset random \
        --random-input-len 256 --random-output-len 64 --num-prompts 48 --request-rate 0.5,1.0,1.5 \
        --goodput ttft:2000 tpot:250 --seed 1

Streams every request (SSE), measures TTFT, TPOT, ITL and E2E per request, and writes a JSON file
of the figures and every request's timings, plus PNG plots (`pip install -e '.[bench]'`). Requests
are sent only to --base-url. Every request ends: each has a deadline, and failures are counted and
listed. Several rates run one after another, each on fresh prompts (seed + i), because the server's
prefix cache would otherwise turn later runs into cache hits. A request's arrival is the moment it
is sent (with --max-concurrency, once it has a slot), as in `vllm bench serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import serve_data  # noqa: E402
from bench.serve_client import Target, counter_deltas, fetch_models, run_workload, scrape_counters  # noqa: E402
from bench.serve_data import DATASETS, Session, TokenSpace, assign_arrivals  # noqa: E402
from bench.serve_metrics import (RequestResult, format_slowest, format_summary, max_rate_meeting_slos,  # noqa: E402
                                 parse_slos, slowest_ttfts, summarize, summarize_by_kind)


def build_sessions(args, space: TokenSpace, seed: int) -> list[Session]:
    if args.dataset == "random":
        return serve_data.random_sessions(space, args.num_prompts, args.random_input_len, args.random_output_len,
                                          seed, args.random_range_ratio)
    if args.dataset == "prefix-repetition":
        return serve_data.prefix_repetition_sessions(space, args.num_prompts, args.prefix_num_prefixes,
                                                     args.prefix_len, args.prefix_suffix_len,
                                                     args.prefix_output_len, seed)
    if args.dataset == "multi-turn":
        return serve_data.multi_turn_sessions(space, args.num_prompts, args.multi_turn_turns,
                                              args.multi_turn_input_len, args.multi_turn_output_len, seed)
    return serve_data.long_prompt_burst_sessions(space, args.num_prompts, args.burst_short_input_len,
                                                 args.burst_short_output_len, args.burst_long_input_len,
                                                 args.burst_long_output_len, args.burst_every, args.burst_size,
                                                 seed)


async def run_one(args, target: Target, space: TokenSpace, rate: float, seed: int, slos: dict) -> dict:
    """One run at one rate: the summary, per-kind summaries, server counter deltas and every request."""
    sessions = build_sessions(args, space, seed)
    assign_arrivals(sessions, rate, args.burstiness, seed)
    before = await scrape_counters(target.base_url)
    results, duration = await run_workload(target, sessions, args.max_concurrency, not args.disable_tqdm)
    await asyncio.sleep(args.metrics_settle_s)  # workers report their stats periodically
    after = await scrape_counters(target.base_url)
    return {"request_rate": rate, "seed": seed, "summary": summarize(results, duration, slos),
            "by_kind": summarize_by_kind(results, duration, slos), "server_counters": counter_deltas(before, after),
            "slowest_ttfts": slowest_ttfts(results), "requests": [r.to_dict() for r in results]}


def load_token_space(tokenizer_dir: str | None) -> TokenSpace:
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        from engine.model_loader import default_model_dir

        tokenizer_dir = str(default_model_dir())
    return TokenSpace.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir))


def parse_rates(text: str) -> list[float]:
    return [math.inf if r.strip() == "inf" else float(r) for r in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name sent in each request (default: the server's first model)")
    p.add_argument("--endpoint", default=None,
                   help="/v1/completions (default) or /v1/chat/completions (the default for multi-turn)")
    p.add_argument("--api-key")
    p.add_argument("--tandem-trace", action="store_true",
                   help="ask a tandem server for each request's stage timeline (X-Tandem-Trace: 1) and list "
                        "where the slowest first tokens spent their time")
    p.add_argument("--tokenizer", help="HF tokenizer directory (default: tandem's converted SmolLM2)")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate (turns, for multi-turn)")
    p.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                   help="req/s, or several comma-separated for a sweep; inf sends everything at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrivals; rate i of a sweep uses seed + i")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:2000 tpot:250")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is failed")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--prefix-suffix-len", type=int, default=64)
    p.add_argument("--prefix-output-len", type=int, default=32)
    p.add_argument("--multi-turn-turns", type=int, default=4)
    p.add_argument("--multi-turn-input-len", type=int, default=64, help="tokens drawn for each user message")
    p.add_argument("--multi-turn-output-len", type=int, default=64)
    p.add_argument("--burst-short-input-len", type=int, default=64)
    p.add_argument("--burst-short-output-len", type=int, default=64)
    p.add_argument("--burst-long-input-len", type=int, default=1536)
    p.add_argument("--burst-long-output-len", type=int, default=8)
    p.add_argument("--burst-every", type=int, default=8, help="short requests between bursts")
    p.add_argument("--burst-size", type=int, default=2, help="long prompts per burst")
    p.add_argument("--metrics-settle-s", type=float, default=2.0, help="wait before scraping /metrics after a run")
    p.add_argument("--result-dir", default="bench/results", help="where the JSON file and plots go")
    p.add_argument("--label", default="serve", help="file name stem of the results")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


async def benchmark(args) -> dict:
    """Every rate of args, one after another; the dict that serve.py writes as JSON."""
    slos = parse_slos(args.goodput)
    model = args.model or (await fetch_models(args.base_url, args.api_key))[0]
    endpoint = args.endpoint or ("/v1/chat/completions" if args.dataset == "multi-turn" else "/v1/completions")
    if args.dataset == "multi-turn" and endpoint != "/v1/chat/completions":
        raise SystemExit("multi-turn needs --endpoint /v1/chat/completions")
    target = Target(args.base_url.rstrip("/"), model, endpoint, args.api_key, args.request_timeout,
                    extra_headers={"X-Tandem-Trace": "1"} if args.tandem_trace else {})
    space = load_token_space(args.tokenizer)
    runs = []
    for i, rate in enumerate(args.request_rate):
        run = await run_one(args, target, space, rate, args.seed + i, slos)
        print(format_summary(run["summary"], f"{args.label} @ {rate:g} req/s"), flush=True)
        if run["slowest_ttfts"]:
            print(format_slowest(run["slowest_ttfts"]), flush=True)
        runs.append(run)
    out = {"base_url": target.base_url, "model": model, "endpoint": endpoint, "dataset": args.dataset,
           "args": {k: v for k, v in vars(args).items() if k != "api_key"}, "runs": runs}
    if slos and len(runs) > 1:
        out["max_rate_meeting_slos"] = max_rate_meeting_slos([(r["request_rate"], r["summary"]) for r in runs])
    return out


def write_outputs(out: dict, result_dir: Path, label: str, plots: bool = True) -> list[Path]:
    """The JSON file, and (with matplotlib) latency CDFs and, for a sweep, the rate plot."""
    result_dir.mkdir(parents=True, exist_ok=True)
    paths = [result_dir / f"{label}.json"]
    paths[0].write_text(json.dumps(out, indent=1, default=str))
    if not plots:
        return paths
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("no plots: matplotlib is missing (pip install -e '.[bench]')")
        return paths
    from bench.serve_plots import plot_latency_cdfs, plot_rate_sweep

    runs = {f"{r['request_rate']:g} req/s": [RequestResult(**{k: v for k, v in q.items() if k != "tpot"})
                                            for q in r["requests"]] for r in out["runs"]}
    paths.append(plot_latency_cdfs(runs, result_dir / f"{label}_cdf.png", label))
    if len(out["runs"]) > 1:
        sweep = [(r["request_rate"], r["summary"]) for r in out["runs"]]
        paths.append(plot_rate_sweep({label: sweep}, result_dir / f"{label}_rates.png", label))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = asyncio.run(benchmark(args))
    except ValueError as exc:
        print(f"serve.py: {exc}", file=sys.stderr)
        return 2
    except aiohttp.ClientError as exc:
        print(f"serve.py: cannot reach {args.base_url}: {exc}; is the server up?", file=sys.stderr)
        return 1
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in write_outputs(out, Path(args.result_dir) / stamp, args.label, not args.no_plots):
        print(f"wrote {path}")
    return 0 if all(r["summary"]["failed"] == 0 for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
