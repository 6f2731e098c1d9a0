"""Tracing on against tracing off through the real server, in one run.

    .venv/bin/python bench/tracing.py --rounds 3 --num-prompts 32 --random-input-len 128 --random-output-len 32

Two tandem apps on one local Ray and Serve instance, alike but for tracing: `off` has no OTLP endpoint
(no span is made), `on` exports every request's spans (ingress, prefill, decode) to an OTLP/HTTP
collector in this process, and its requests also ask for the timeline in the response
(X-Tandem-Trace: 1). After one warm-up run on each, each round runs bench/serve.py's workload against
both, alternating which goes first (fresh prompts each time, so the prefix cache helps neither), and the result is the ratio of output-token throughput
on/off per round and over all rounds. Stage timelines themselves are always kept (they feed the metrics).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.api import RunTarget  # noqa: E402

from bench.serve import build_parser as serve_parser, load_token_space, run_one  # noqa: E402
from bench.serve_client import Target  # noqa: E402
from cluster.app import build_app, shutdown_cluster  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests.otlp_collector import OTLPCollector  # noqa: E402


def configs(collector_url: str, model: str | None) -> dict[str, ClusterConfig]:
    common = dict(model=model, prefill={"replicas": 1}, decode={"replicas": 1})
    return {"off": ClusterConfig(name="bench-trace-off", **common),
            "on": ClusterConfig(name="bench-trace-on", tracing={"otlp_endpoint": collector_url}, **common)}


async def rounds(args, urls: dict[str, str]) -> list[dict]:
    serve_args = serve_parser().parse_args([
        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len), "--max-concurrency", str(args.max_concurrency),
        "--disable-tqdm", "--metrics-settle-s", "0"])
    space = load_token_space(args.model)
    model = ClusterConfig(model=args.model).model_name
    targets = {name: Target(urls[name], model, extra_headers={"X-Tandem-Trace": "1"} if name == "on" else {})
               for name in ("off", "on")}
    for i, target in enumerate(targets.values()):  # warm-up, not measured
        await run_one(serve_args, target, space, float("inf"), args.seed - 1 - i, {})
    out = []
    for r in range(args.rounds):
        row = {"round": r}
        # Alternate which goes first, so a drift of the shared machine's load does not favour one side.
        for i, name in enumerate(("off", "on") if r % 2 == 0 else ("on", "off")):
            run = await run_one(serve_args, targets[name], space, float("inf"), args.seed + 2 * r + i, {})
            row[name] = run["summary"]
        row["ratio"] = row["on"]["output_throughput"] / row["off"]["output_throughput"]
        print(f"round {r}: off {row['off']['output_throughput']:.1f} tok/s, on {row['on']['output_throughput']:.1f} "
              f"tok/s, on/off {row['ratio']:.3f}", flush=True)
        out.append(row)
    return out


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
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    apps = configs(collector.url, args.model)
    try:
        serve.run_many([RunTarget(build_app(c), name=n, route_prefix=f"/{n}") for n, c in apps.items()])
        results = asyncio.run(rounds(args, {n: f"http://127.0.0.1:{port}/{n}" for n in apps}))
    finally:
        serve.shutdown()
        for c in apps.values():
            shutdown_cluster(c.name)
        ray.shutdown()
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
