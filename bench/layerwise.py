"""Layer-wise KV pipelining on the request path: time to first and to second token, normal vs layer-wise.

Two disaggregated clusters of the same model run side by side on a local Ray: one leases the KV after
the first token (normal), one leases it when the prompt's last chunk is scheduled and streams layers as
the forward writes them (`transfer.layerwise`). Requests go one at a time through
router.placement.dispatch.run_request, alternating between the two, each with a fresh random prompt (no prefix
hits, so decode pulls every block). Medians over the requests of each prompt length.

    .venv/bin/python bench/layerwise.py --requests 7 --prompt-lens 1024 2048
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
from engine import SamplingParams  # noqa: E402
from worker_runtime.protocol import GenerateRequest  # noqa: E402
from router.placement.dispatch import run_request  # noqa: E402
from router.placement.routing import dispatch_path  # noqa: E402

MODES = ("normal", "layerwise")
WIDTHS = (9, 11, 11, 9)


def start(mode: str, args) -> Pools:
    config = ClusterConfig(model=args.model, name=f"bench-{mode}",
                           prefill={"num_threads": args.prefill_threads},
                           decode={"num_threads": args.decode_threads},
                           transfer={"layerwise": mode == "layerwise"})
    pools = Pools(config)
    pools.start()
    return pools


def actors(pools: Pools):
    """(decode actor, prefill actor, whether the prefill worker leases layer-wise)."""
    return (next(iter(pools.decode.workers.values())).actor, next(iter(pools.prefill.workers.values())).actor,
            pools.config.transfer.layerwise)


async def one(name: str, prompt: list[int], decode, prefill, layerwise: bool) -> tuple[float, float, float]:
    """Seconds from dispatch to the first and to the second token, and the prefill worker's own time
    from queueing the request to sampling its first token."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    start = time.perf_counter()
    stamps, prefill_s = [], 0.0
    request = GenerateRequest(name, prompt, params)
    request.dispatch = dispatch_path(request, True, layerwise)
    async for delta in run_request(request, decode, prefill):
        stamps.extend([time.perf_counter() - start] * len(delta.new_token_ids))
        if "prefill_done" in delta.times:
            prefill_s = delta.times["prefill_done"] - delta.times["prefill_queued"]
    return stamps[0], stamps[1], prefill_s


async def measure(args, clusters: dict[str, Pools]) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
    rng = random.Random(0)
    samples: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for length in args.prompt_lens:
        for mode in MODES:  # warm-up at this length
            await one(f"warm-{mode}-{length}", [rng.randrange(100, 40000) for _ in range(length)],
                      *actors(clusters[mode]))
        for i in range(args.requests):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                prompt = [rng.randrange(100, 40000) for _ in range(length)]
                samples.setdefault((mode, length), []).append(
                    await one(f"{mode}-{length}-{i}", prompt, *actors(clusters[mode])))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=7, help="per mode and prompt length")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--prefill-threads", type=int, default=1)
    parser.add_argument("--decode-threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    clusters = {mode: start(mode, args) for mode in MODES}
    try:
        samples = asyncio.run(measure(args, clusters))
        overlapped = ray.get(actors(clusters["layerwise"])[1].transfer_stats.remote())
    finally:
        for pools in clusters.values():
            pools.shutdown()
        ray.shutdown()
    print(f"{args.requests} requests per mode and length, alternating; medians in ms")
    print(f"{'prompt':>7} {'mode':<10}{'TTFT':>9}{'2nd token':>11}{'2nd - 1st':>11}{'prefill':>9}")
    for length in args.prompt_lens:
        rows = {}
        for mode in MODES:
            runs = samples[(mode, length)]
            rows[mode] = [statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs),
                          statistics.median(s[1] - s[0] for s in runs), statistics.median(s[2] for s in runs)]
            print(f"{length:>7} {mode:<10}" + "".join(f"{v * 1e3:>{w}.1f}" for v, w in zip(rows[mode], WIDTHS)))
        delta = [b - a for a, b in zip(rows["normal"], rows["layerwise"])]
        print(f"{length:>7} {'change':<10}" + "".join(f"{v * 1e3:>+{w}.1f}" for v, w in zip(delta, WIDTHS)))
        for mode in MODES:
            print(f"        {mode} TTFT each: " + " ".join(f"{s[0] * 1e3:.0f}" for s in samples[(mode, length)]))
    print(f"layer-wise forwards that ended with a pull already open: "
          f"{overlapped['forwards_ended_with_pull_open']} of {overlapped['layerwise_leases']} leases")


if __name__ == "__main__":
    main()
