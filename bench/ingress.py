"""What the ingress adds to a request: the same worker driven directly (run_request in this process,
token ids in, no HTTP) versus through the Serve app (HTTP, auth, validation, tokenization, routing, SSE).

    .venv/bin/python bench/ingress.py [--requests 60] [--concurrency 8] [--max-tokens 16]

A tiny random model keeps the model's own time small, so the difference is the ingress path. One
colocated decode worker serves both paths, one after the other.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The repo before bench/: bench/router.py would otherwise shadow the `router` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import requests  # noqa: E402

from cluster.config import ClusterConfig  # noqa: E402
from cluster.controller import get_controller  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.model_loader import build_random_model, load_tokenizer  # noqa: E402
from worker_runtime.protocol import GenerateRequest  # noqa: E402
from router.placement.dispatch import run_request  # noqa: E402
from local_serve import serve_app  # noqa: E402  (bench/, beside this script)

PROMPT = "Benchmarks measure what the ingress adds to every request, " * 2


def percentiles(latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return f"p50 {statistics.median(ms):7.1f} ms   p99 {p99:7.1f} ms"


def direct(decode, ids: list[int], n: int, concurrency: int, max_tokens: int) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> float:
        started = time.perf_counter()
        async for _ in run_request(GenerateRequest(f"direct-{i}-{time.time()}", ids, params), decode):
            pass
        return time.perf_counter() - started

    async def main() -> list[float]:
        gate = asyncio.Semaphore(concurrency)

        async def gated(i: int) -> float:
            async with gate:
                return await one(i)
        return await asyncio.gather(*(gated(i) for i in range(n)))

    return asyncio.run(main())


def through_ingress(url: str, n: int, concurrency: int, max_tokens: int) -> list[float]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    sessions = [requests.Session() for _ in range(concurrency)]

    def one(i: int) -> float:
        started = time.perf_counter()
        response = sessions[i % concurrency].post(f"{url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return time.perf_counter() - started

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    model = str(build_random_model(os.path.join(tempfile.gettempdir(), "tandem-bench-tiny-llama"), seed=0))
    ids = load_tokenizer(model).encode(PROMPT)
    config = ClusterConfig(model=model, served_model_name="tiny", name="bench-ingress", mode="colocated",
                           engine={"num_kv_blocks": 256})
    with serve_app(config) as url:
        [decode] = [w.actor for w in ray.get(get_controller(config.name).membership.remote()).workers]
        through_ingress(url, 8, 2, args.max_tokens)  # warm both paths
        direct(decode, ids, 8, 2, args.max_tokens)
        print(f"{len(ids)}-token prompt, {args.max_tokens} tokens out, {args.requests} requests each")
        for concurrency in (1, args.concurrency):
            base = direct(decode, ids, args.requests, concurrency, args.max_tokens)
            ours = through_ingress(url, args.requests, concurrency, args.max_tokens)
            print(f"concurrency {concurrency:2d}  direct run_request  {percentiles(base)}")
            print(f"concurrency {concurrency:2d}  through ingress     {percentiles(ours)}   "
                  f"({(statistics.median(ours) - statistics.median(base)) * 1000:+.1f} ms at p50)")


if __name__ == "__main__":
    main()
