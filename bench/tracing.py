"""Tracing on against tracing off through the real server, in one run.

    .venv/bin/python bench/tracing.py --rounds 3 --num-prompts 32 --random-input-len 128 --random-output-len 32

The same tandem app (one prefill and one decode worker, the default model) is started alike but for
tracing: `off` has no OTLP endpoint (no span is made), `on` exports every request's spans (ingress,
prefill, decode) to an OTLP/HTTP collector in this process, and its requests also ask for the timeline
in the response (X-Tandem-Trace: 1). Each round starts each side in turn on a fresh local Ray (so both
get the machine, and its cores, alike), which is used for a warm-up run and then bench/serve.py's
measured workload, alternating which side goes first; every run has fresh prompts, so the prefix cache
helps neither. The result is the ratio of output-token throughput on/off per round and over all rounds.
Stage timelines themselves are always kept (they feed the metrics and `tandem trace`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.local_serve import serve_app  # noqa: E402
from bench.serve import build_parser as serve_parser, load_token_space, run_one  # noqa: E402
from bench.serve_client import Target  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from bench.otlp_collector import OTLPCollector  # noqa: E402


def config(side: str, collector_url: str, model: str | None) -> ClusterConfig:
    tracing = {"otlp_endpoint": collector_url} if side == "on" else {}
    return ClusterConfig(model=model, name=f"bench-trace-{side}", tracing=tracing, prefill={"replicas": 1},
                         decode={"replicas": 1})


async def measure(args, side: str, base_url: str, seed: int) -> dict:
    """A warm-up run, then the measured one; the measured run's summary."""
    serve_args = serve_parser().parse_args([
        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len), "--max-concurrency", str(args.max_concurrency),
        "--disable-tqdm", "--metrics-settle-s", "0"])
    space = load_token_space(args.model)
    target = Target(base_url, ClusterConfig(model=args.model).model_name,
                    extra_headers={"X-Tandem-Trace": "1"} if side == "on" else {})
    await run_one(serve_args, target, space, float("inf"), seed + 10_000, {})
    return (await run_one(serve_args, target, space, float("inf"), seed, {}))["summary"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--out", default="bench/results/tracing.json")
    args = p.parse_args(argv)
    collector = OTLPCollector().start()
    results = []
    try:
        for r in range(args.rounds):
            row = {"round": r}
            # Alternate which goes first, so a drift of the shared machine's load favours neither side.
            for i, side in enumerate(("off", "on") if r % 2 == 0 else ("on", "off")):
                with serve_app(config(side, collector.url, args.model)) as base_url:
                    row[side] = asyncio.run(measure(args, side, base_url, args.seed + 2 * r + i))
            row["ratio"] = row["on"]["output_throughput"] / row["off"]["output_throughput"]
            print(f"round {r}: off {row['off']['output_throughput']:.1f} tok/s, on "
                  f"{row['on']['output_throughput']:.1f} tok/s, on/off {row['ratio']:.3f}", flush=True)
            results.append(row)
    finally:
        collector.stop()
    ratios = [r["ratio"] for r in results]
    summary = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rounds": results,
               "ratio_mean": statistics.mean(ratios), "ratio_median": statistics.median(ratios),
               "spans_received": len(collector.spans)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"on/off output throughput: mean {summary['ratio_mean']:.3f}, median {summary['ratio_median']:.3f} "
          f"over {len(ratios)} rounds; {summary['spans_received']} spans received", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
