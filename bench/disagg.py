"""Overhead of the disaggregated path against the bare engine: TTFT and mean ITL, median over N requests.

Both sides run the same prompts one at a time with greedy decoding on the same model and thread count.
The bare engine is stepped in a child process without Ray; the disaggregated path is a prefill actor and
a decode actor on a local Ray (KV over gRPC), driven through router.placement.dispatch.run_request as the ingress
does. Each prompt runs on both paths back to back, in alternating order, so that the drifts of a shared
machine hit both. "KV pull" is the decode worker's own measure of the pull (part of the first gap).

    .venv/bin/python bench/disagg.py --requests 20 --prompt-len 256 --output-len 32 --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
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
from worker_runtime.protocol import GenerateRequest  # noqa: E402
from router.placement.dispatch import run_request  # noqa: E402
from router.placement.routing import dispatch_path  # noqa: E402


def timing(start: float, stamps: list[float]) -> tuple[float, float, float, float]:
    """TTFT, mean ITL, the first gap (first to second token: on the disaggregated path it holds the
    KV pull) and the mean of the later gaps (steady decoding)."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, statistics.mean(gaps), gaps[0], statistics.mean(gaps[1:])


def summarize(samples: list[tuple[float, ...]]) -> tuple[float, ...]:
    return tuple(statistics.median(column) for column in zip(*samples))


_engine: Engine | None = None  # the bare engine, in the child process


def start_bare_engine(threads: int, model: str | None) -> None:
    global _engine
    os.nice(15)  # Ray runs its workers at niceness 15: the baseline gets no priority the actors lack
    _engine = Engine(EngineConfig(model=model, num_threads=threads))


def bare_request(request_id: str, prompt: list[int], params: SamplingParams) -> tuple[float, ...]:
    start = time.perf_counter()
    _engine.add_request(request_id, prompt, params)
    stamps = []
    while _engine.has_unfinished_requests():
        for _ in _engine.step():
            stamps.append(time.perf_counter())
    return timing(start, stamps)


async def disaggregated_request(request_id: str, prompt: list[int], params: SamplingParams, decode,
                                prefill, layerwise: bool) -> tuple[float, ...]:
    start = time.perf_counter()
    stamps, times = [], {}
    request = GenerateRequest(request_id, prompt, params)
    request.dispatch = dispatch_path(request, True, layerwise)
    async for delta in run_request(request, decode, prefill):
        stamps.extend([time.perf_counter()] * len(delta.new_token_ids))
        times = delta.times or times
    pull = times.get("transfer_done", 0.0) - times.get("transfer_started", 0.0)
    return timing(start, stamps) + (pull,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of --requests requests, after a warm-up round")
    parser.add_argument("--layerwise", action="store_true", help="layer-wise KV pull (transfer.layerwise)")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # The bare engine runs in a child process that never attaches to Ray: a driver process with Ray
    # attached slows in-process torch work down several times on this machine.
    child = multiprocessing.get_context("spawn").Pool(1, start_bare_engine, (args.threads, args.model))
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    config = ClusterConfig(model=args.model, prefill={"num_threads": args.threads},
                           decode={"num_threads": args.threads}, transfer={"layerwise": args.layerwise})
    pools = Pools(config)
    pools.start()
    prefill = next(iter(pools.prefill.workers.values())).actor
    decode = next(iter(pools.decode.workers.values())).actor
    rng = random.Random(0)
    rows, bare_all, dis_all = [], [], []

    async def run_round(name: str, num_requests: int) -> None:
        bare, dis = [], []
        for i in range(num_requests):
            # Each request has a fresh prompt, run on both paths back to back (in alternating order).
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
            first_bare = i % 2 == 0
            if first_bare:
                bare.append(child.apply(bare_request, (f"bare-{name}-{i}", prompt, params)))
            dis.append(await disaggregated_request(f"dis-{name}-{i}", prompt, params, decode, prefill,
                                                   args.layerwise))
            if not first_bare:
                bare.append(child.apply(bare_request, (f"bare-{name}-{i}", prompt, params)))
        if name != "warm-up":
            bare_all.extend(bare)
            dis_all.extend(dis)
            rows.append((name, summarize(bare), summarize(dis)))

    async def run_all() -> None:
        await run_round("warm-up", 2)
        for r in range(1, args.rounds + 1):
            await run_round(str(r), args.requests)

    try:
        asyncio.run(run_all())
    finally:
        child.terminate()
        pools.shutdown()
        ray.shutdown()
    rows.append(("all", summarize(bare_all), summarize(dis_all)))
    header = ["TTFT", "ITL", "1st gap", "later ITL", "KV pull"]
    print(f"{'round':<7}{'path':<16}" + "".join(f"{h:>12}" for h in header) + "   (ms, medians over requests)")
    for name, bare, dis in rows:
        bare = bare + (0.0,)  # no pull on the bare engine
        for label, values in (("bare engine", bare), ("disaggregated", dis),
                              ("overhead", [d - b for d, b in zip(dis, bare)])):
            sign = "+" if label == "overhead" else ""
            print(f"{name if label == 'bare engine' else '':<7}{label:<16}"
                  + "".join(f"{v * 1e3:>{sign}12.2f}" for v in values))

if __name__ == "__main__":
    main()
