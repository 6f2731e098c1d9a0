"""KV tiers on against off, on one engine each, in one run (issue 41): a prefix-heavy workload that the KV
cache cannot hold.

Workload: `--prefixes` system prompts of `--prefix-len` tokens (a range: uniform), picked with Zipf popularity
(exponent `--zipf`), each followed by a short question of `--question-len` fresh tokens; `--requests` of them,
one at a time, greedy, `--output-len` tokens each. Both engines get the default model at the same precision
and a KV cache of `--cache-share` of the prefixes' blocks; the tiered one also gets a host tier holding all
of them (`--host-gb`). Requests alternate between the two engines (the same request to each in turn), so the
machine's noise falls on both. Reported per engine: prompt tokens computed per request (prompt − cached), TTFT
p50/p99 (add to first token), ITL p50 (mean gap per request), and per tier hits; the ratios tiers / none.
Outputs must be equal (greedy, same precision): the script fails otherwise.

Run: .venv/bin/python bench/kv_tiers.py
     .venv/bin/python bench/kv_tiers.py --prefixes 32 --prefix-len 1024 2048 --requests 96   (the issue's size)
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.stdout.reconfigure(line_buffering=True)

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.kv_tiers_config import KVTiersConfig  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, nargs=2, default=(512, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--cache-share", type=float, default=0.25, help="of the prefixes' blocks the KV cache holds")
    p.add_argument("--host-gb", type=float, default=None, help="host tier size (default: all prefixes, +25%%)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.prefix_len))] for _ in range(args.prefixes)]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.prefixes)]
    picks = rng.choices(range(args.prefixes), weights, k=args.requests)
    return [prefixes[i] + [rng.randrange(3, vocab) for _ in range(args.question_len)] for i in picks]


def run_one(engine: Engine, prompt: list[int], params: SamplingParams, rid: str) -> tuple[float, float, int, list]:
    """(TTFT s, mean ITL s, prompt tokens computed, output ids) of one request alone on `engine`."""
    started = time.perf_counter()
    req = engine.add_request(rid, prompt, params)
    times, ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                times.append(time.perf_counter())
                ids.extend(out.new_token_ids)
    ttft = times[0] - started
    itl = (times[-1] - times[0]) / max(1, len(times) - 1)
    return ttft, itl, len(prompt) - req.num_cached_tokens, ids


def main(argv=None) -> int:
    args = parse_args(argv)
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0)
    probe = Engine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads, num_kv_blocks=16))
    vocab, layout = probe.runner.vocab_size, probe.kv_cache.layout
    probe.close()
    del probe
    prompts = workload(args, vocab)
    bs = layout.block_size
    prefix_blocks = sum(-(-len(p) // bs) for p in {tuple(p[:-args.question_len]) for p in prompts})
    all_blocks = -(-args.prefixes * sum(args.prefix_len) // 2 // bs)
    num_blocks = max(int(all_blocks * args.cache_share), -(-(max(args.prefix_len) + args.question_len
                                                             + args.output_len) // bs) + 1)
    block_bytes = 2 * layout.num_layers * layout.bytes_per_block_per_layer
    host_gb = args.host_gb or all_blocks * 1.25 * block_bytes / 2**30
    print(f"{args.requests} requests over {args.prefixes} prefixes of {args.prefix_len[0]}-{args.prefix_len[1]} "
          f"tokens (Zipf {args.zipf}; {prefix_blocks} blocks of the prefixes used); KV cache {num_blocks} blocks "
          f"({args.cache_share:.0%} of ~{all_blocks}); host tier {host_gb:.2f} GiB; dtype {layout.dtype}")
    engines = {
        "tiers": Engine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                     num_kv_blocks=num_blocks, kv_tiers=KVTiersConfig(host_gb=host_gb))),
        "none": Engine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                    num_kv_blocks=num_blocks)),
    }
    results = {name: [] for name in engines}
    for i, prompt in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            results[name].append(run_one(engines[name], prompt, params, f"r{i}"))
        if results["tiers"][-1][3] != results["none"][-1][3]:
            print(f"request {i}: outputs differ between tiers and none", file=sys.stderr)
            return 1
    summary = {}
    for name, rows in results.items():
        ttfts = sorted(r[0] for r in rows)
        summary[name] = {"computed": statistics.mean(r[2] for r in rows),
                         "ttft_p50": statistics.median(ttfts),
                         "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
                         "itl_p50": statistics.median(r[1] for r in rows)}
    print(f"{'':8} {'computed/req':>13} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>9}")
    for name, s in summary.items():
        print(f"{name:8} {s['computed']:13.1f} {s['ttft_p50'] * 1e3:8.1f}ms {s['ttft_p99'] * 1e3:8.1f}ms "
              f"{s['itl_p50'] * 1e3:7.2f}ms")
    t, n = summary["tiers"], summary["none"]
    print(f"tiers / none: computed {t['computed'] / n['computed']:.2f}x, TTFT p50 {t['ttft_p50'] / n['ttft_p50']:.2f}x, "
          f"p99 {t['ttft_p99'] / n['ttft_p99']:.2f}x, ITL p50 {t['itl_p50'] / n['itl_p50']:.2f}x")
    tier_stats = engines["tiers"].stats()["kv_tiers"]
    bm = engines["tiers"].block_manager
    device_hits = bm.prefix_cache_hits // bs - sum(t["hits"] for t in tier_stats["tiers"].values())
    queried = bm.prefix_cache_queries
    print(f"hit rate (tokens of prompts): device {device_hits * bs / queried:.1%}, "
          + ", ".join(f"{name} {t['hits'] * bs / queried:.1%}" for name, t in tier_stats["tiers"].items())
          + f"; without tiers: device {engines['none'].block_manager.prefix_cache_hits / queried:.1%}"
          + f"; copy failures {tier_stats['copy_failures']}")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
