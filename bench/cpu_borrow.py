"""Core borrowing through the real app: a prefill worker and a decode worker pinned to one core each;
with `cpu.borrow` the prefill's forwards also run on the decode worker's core while it is idle.

    flock /tmp/tandem-bench.lock .venv/bin/python bench/cpu_borrow.py [--prompts 8] [--streams 3]

For borrow on and off (a fresh app each): the TTFT of 256-token prompts with decode idle, then the
decode streams' inter-token latency while 256-token prompts arrive (decode busy: a prefill must keep to
its own core). Prompts are random token ids (no prefix hits); every prompt is prefilled remotely
(router.max_local_prefill_length 0), so the measurement does not depend on the placement policy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import requests  # noqa: E402

from cluster.config import ClusterConfig  # noqa: E402
from cluster.controller import get_controller  # noqa: E402
from local_serve import serve_app  # noqa: E402  (bench/, beside this script)

VOCAB = 49152


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def stream(url: str, ids: list[int], max_tokens: int, since: float | None = None) -> list[float]:
    """Send one streamed completion; the arrival time of each chunk that carries text, from the send (or
    from `since`)."""
    body = {"model": "smollm2-135m-instruct", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started, times = time.perf_counter(), []
    since = started if since is None else since
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter() - since)
    return times


def ms(values: list[float]) -> str:
    values = sorted(v * 1000 for v in values)
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return f"median {statistics.median(values):6.0f} ms  mean {statistics.mean(values):6.0f}  " \
           f"min {values[0]:6.0f}  p99 {p99:6.0f}  (n={len(values)})"


def placements(config: ClusterConfig) -> dict[str, dict]:
    workers = ray.get(get_controller(config.name).membership.remote()).workers
    return {w.worker_id: ray.get(w.actor.cpu_placement.remote()) for w in workers}


def idle_ttft(url: str, rng: random.Random, n: int) -> list[float]:
    ttfts = []
    for _ in range(n):
        ttfts.append(stream(url, prompt(rng, 256), 4)[0])
        time.sleep(0.3)  # decode finishes and idles again
    return ttfts


def borrowing_steps(config: ClusterConfig) -> int:
    return sum(p.get("borrowing_steps", 0) for p in placements(config).values())


def busy_itl(url: str, rng: random.Random, streams: int, arrivals: int, config: ClusterConfig):
    """ITL of `streams` long decode streams (all gaps; the gaps while `arrivals` 256-token prompts come in
    one after another), those prompts' TTFT and the prefill steps that ran on borrowed cores meanwhile."""
    results: list[list[float]] = []
    prompts = [prompt(rng, 32) for _ in range(streams)]
    zero = time.perf_counter()
    threads = [threading.Thread(target=lambda p=p: results.append(stream(url, p, 160, zero))) for p in prompts]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the streams are decoding
    before, first = borrowing_steps(config), time.perf_counter() - zero
    ttfts = [stream(url, prompt(rng, 256), 2)[0] for _ in range(arrivals)]
    borrowed, last = borrowing_steps(config) - before, time.perf_counter() - zero
    for t in threads:
        t.join()
    gaps = [(b - a, first <= b <= last) for times in results for a, b in zip(times, times[1:])]
    return [g for g, _ in gaps], [g for g, during in gaps if during], ttfts, borrowed


def run(borrow: bool, args) -> None:
    config = ClusterConfig(name="bench-borrow", router={"max_local_prefill_length": 0}, cpu={"borrow": borrow},
                           prefill={"num_cpus": 1}, decode={"num_cpus": 1})
    rng = random.Random(args.seed + borrow)
    with serve_app(config) as url:
        stream(url, prompt(rng, 256), 4)  # warm up
        print(f"borrow {'on ' if borrow else 'off'}: workers {placements(config)}")
        print(f"  TTFT, 256-token prompt, decode idle:   {ms(idle_ttft(url, rng, args.prompts))}")
        gaps, during, ttfts, borrowed = busy_itl(url, rng, args.streams, args.arrivals, config)
        print(f"  decode ITL, {args.streams} streams, all gaps:    {ms(gaps)}")
        print(f"  decode ITL while the prompts arrive:  {ms(during)}")
        print(f"  TTFT of those prompts (decode busy):   {ms(ttfts)}")
        print(f"  prefill steps on borrowed cores while they arrived: {borrowed}")
        print(f"  after: {placements(config)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--arrivals", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for borrow in (True, False):
        run(borrow, args)


if __name__ == "__main__":
    main()
