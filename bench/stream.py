"""What serving costs per streamed token: the offline engine against the same engine served (colocated, one
decode worker, Ray streaming generator, ingress, SSE, Serve proxy), in one run, on a decode-bound load.

    flock /tmp/tandem-bench.lock .venv/bin/python bench/stream.py [--streams 16] [--output-len 128] [--rounds 3]

Both paths run N requests of random prompt ids at once, greedy, exactly `--output-len` tokens each
(ignore_eos); the served ones are streamed completions (`stream: true`, usage in the last chunk) read by
one asyncio client. The offline engine runs in a Ray actor with the decode worker's threads, niceness and
cores, so both see the machine alike; rounds alternate the two paths, and the ratio within a round and
that of each path's best round (the least disturbed) are the numbers to trust on a shared machine.
"chunks/stream" counts SSE events per stream: fewer than the tokens when deltas coalesce.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import aiohttp  # noqa: E402
import ray  # noqa: E402

from cluster.config import ClusterConfig  # noqa: E402
from cluster.controller import get_controller  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from local_serve import serve_app  # noqa: E402  (bench/, beside this script)


@ray.remote
class OfflineEngine:
    """The offline engine, in a Ray worker process like the decode worker (same niceness, same threads)."""

    def __init__(self, model: str | None, threads: int):
        self.engine = Engine(EngineConfig(model=model, num_threads=threads))

    def vocab_size(self) -> int:
        return self.engine.runner.vocab_size

    def pin_like(self, pid: int) -> list[int]:
        """Run on the cores the decode worker is pinned to (every thread of this process)."""
        cores = os.sched_getaffinity(pid)
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cores)
        return sorted(cores)

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        started = time.perf_counter()
        outs = self.engine.generate(prompts, params)
        return time.perf_counter() - started, sum(len(o.token_ids) for o in outs)


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int) -> tuple[int, int]:
    """(completion tokens from the usage chunk, SSE events before it)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events, last = 0, b""
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: "):
                events += 1
                if line != b"data: [DONE]\n":
                    last = line
    return json.loads(last[6:])["usage"]["completion_tokens"], events - 2  # not the usage chunk and [DONE]


async def served(url: str, prompts: list[list[int]], output_len: int) -> tuple[float, int, float]:
    connector = aiohttp.TCPConnector(limit=len(prompts))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, url, p, output_len) for p in prompts))
        wall = time.perf_counter() - started
    return wall, sum(r[0] for r in results), statistics.mean(r[1] for r in results)


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both engines")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--served-only", action="store_true", help="skip the offline engine (to profile serving)")
    args = parser.parse_args()

    config = ClusterConfig(model=args.model, served_model_name="bench", name="bench-stream", mode="colocated",
                           decode={"replicas": 1, "num_cpus": args.threads, "num_threads": args.threads},
                           engine={"max_num_seqs": max(64, args.streams)})
    with serve_app(config) as url:
        offline = OfflineEngine.options(num_cpus=0).remote(args.model, args.threads)
        vocab = ray.get(offline.vocab_size.remote())
        warm = make_prompts(args.streams, args.prompt_len, vocab, seed=999)
        ray.get(offline.run.remote(warm, 8))
        asyncio.run(served(url, warm, 8))
        [decode] = [w.actor for w in ray.get(get_controller(config.name).membership.remote()).workers]
        cores = ray.get(offline.pin_like.remote(ray.get(decode.__ray_call__.remote(lambda self: os.getpid()))))
        print(f"{args.streams} streams x {args.prompt_len} prompt x {args.output_len} output tokens, greedy, "
              f"ignore_eos, {args.threads} thread(s), colocated, one decode worker, both on cores {cores}")
        print(f"{'round':<6} {'offline tok/s':>14} {'served tok/s':>13} {'served/offline':>15} {'chunks/stream':>14}")
        ratios, best_offline, best_served = [], 0.0, 0.0
        for r in range(args.rounds):
            # Fresh prompts each round (no prefix hits), the same ones for both paths.
            prompts = make_prompts(args.streams, args.prompt_len, vocab, seed=r)
            wall_s, tokens_s, chunks = asyncio.run(served(url, prompts, args.output_len))
            if args.served_only:
                print(f"{r + 1:<6} {'-':>14} {tokens_s / wall_s:>13.1f} {'-':>15} {chunks:>14.1f}")
                continue
            wall_o, tokens_o = ray.get(offline.run.remote(prompts, args.output_len))
            assert tokens_o == tokens_s == args.streams * args.output_len, (tokens_o, tokens_s)
            ratios.append((tokens_s / wall_s) / (tokens_o / wall_o))
            best_offline, best_served = max(best_offline, tokens_o / wall_o), max(best_served, tokens_s / wall_s)
            print(f"{r + 1:<6} {tokens_o / wall_o:>14.1f} {tokens_s / wall_s:>13.1f} {ratios[-1]:>15.2f} {chunks:>14.1f}")
        if ratios:
            print(f"served/offline over {len(ratios)} rounds: median {statistics.median(ratios):.2f}, "
                  f"min {min(ratios):.2f}, max {max(ratios):.2f}; best served / best offline "
                  f"{best_served:.1f} / {best_offline:.1f} = {best_served / best_offline:.2f}")


if __name__ == "__main__":
    main()
