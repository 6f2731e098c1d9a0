"""Overhead of the disaggregated path against the bare engine: TTFT and mean ITL, median over N requests.

Both sides run the same prompts one at a time with greedy decoding on the same model and thread count.
The bare engine is stepped in-process; the disaggregated path is a prefill actor and a decode actor on
a local Ray (KV over gRPC), driven through router.dispatch.run_request as the ingress does.

    .venv/bin/python bench/disagg.py --requests 20 --prompt-len 256 --output-len 32
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

# bench/router.py would shadow the router package: import from the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from cluster.config import ClusterConfig  # noqa: E402
from cluster.pools import Pools  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.protocol import GenerateRequest  # noqa: E402
from router.dispatch import run_request  # noqa: E402


def summarize(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def bare_engine(prompts, params, threads: int, model: str | None) -> list[tuple[float, float]]:
    engine = Engine(EngineConfig(model=model, num_threads=threads))
    engine.generate([prompts[0]], params)  # warm-up
    samples = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"bare-{i}", prompt, params)
        stamps = []
        while engine.has_unfinished_requests():
            for _ in engine.step():
                stamps.append(time.perf_counter())
        samples.append((stamps[0] - start, statistics.mean(b - a for a, b in zip(stamps, stamps[1:]))))
    return samples


def disaggregated(prompts, params, threads: int, model: str | None) -> list[tuple[float, float]]:
    config = ClusterConfig(model=model, prefill={"num_threads": threads}, decode={"num_threads": threads})
    pools = Pools(config)
    pools.start()
    prefill = next(iter(pools.prefill.workers.values())).actor
    decode = next(iter(pools.decode.workers.values())).actor

    async def one(i, prompt):
        start = time.perf_counter()
        stamps = []
        async for delta in run_request(GenerateRequest(f"dis-{i}", prompt, params), decode, prefill):
            stamps.extend([time.perf_counter()] * len(delta.token_ids))
        return stamps[0] - start, statistics.mean(b - a for a, b in zip(stamps, stamps[1:]))

    async def main():
        await one(-1, prompts[0])  # warm-up
        return [await one(i, p) for i, p in enumerate(prompts)]

    try:
        return asyncio.run(main())
    finally:
        pools.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # The bare engine runs first, before Ray exists: a driver process with Ray attached slows in-process
    # torch work down several times on this machine.
    bare = summarize(bare_engine(prompts, params, args.threads, args.model))
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    dis = summarize(disaggregated(prompts, params, args.threads, args.model))
    print(f"{'path':<16}{'TTFT ms (median)':>18}{'ITL ms (median of means)':>28}")
    print(f"{'bare engine':<16}{bare[0] * 1e3:>18.1f}{bare[1] * 1e3:>28.2f}")
    print(f"{'disaggregated':<16}{dis[0] * 1e3:>18.1f}{dis[1] * 1e3:>28.2f}")
    print(f"{'overhead':<16}{(dis[0] - bare[0]) * 1e3:>+18.1f}{(dis[1] - bare[1]) * 1e3:>+28.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
