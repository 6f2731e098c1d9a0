"""Decode steps from the weights' shipped blocks (`engine.weight_blocks: true`, the default) against oneDNN's
fp32 linears (`false`), on the default SmolLM2, in one process, arms alternated.

    taskset -c 1 .venv/bin/python bench/weight_blocks.py                 # one thread, batches 1-32
    taskset -c 0,1 .venv/bin/python bench/weight_blocks.py --threads 2

A step's time = (generate B fresh 256-token prompts for 33 tokens - B others for 1 token) / 32, best of
`--rounds`; the prefill is one 256-token prompt for one token. Also prints how many greedy tokens of 8
prompts x 64 tokens the two arms agree on (the weights are the same; only the order of each dot product's
sum differs, so a near-tie may flip).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model_loader import default_model_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {}
    for blocks in (True, False):
        started = time.perf_counter()
        engines[blocks] = Engine(EngineConfig(model=str(default_model_dir()), num_threads=args.threads,
                                              num_kv_blocks=1024, max_num_batched_tokens=8192, dtype="float32",
                                              weight_blocks=blocks))
        print(f"weight_blocks={blocks}: engine built in {time.perf_counter() - started:.1f} s", flush=True)
    rng = random.Random(0)

    def run(engine: Engine, batch: int, tokens: int) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(batch)]  # fresh: no cache hits
        started = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - started

    for engine in engines.values():
        run(engine, 1, 4)  # warm-up
    best: dict[tuple[bool, int], float] = {}
    prefill: dict[bool, float] = {}
    for _ in range(args.rounds):
        for blocks, engine in engines.items():
            prefill[blocks] = min(prefill.get(blocks, 1e9), run(engine, 1, 1))
            for b in batches:
                step = (run(engine, b, 33) - run(engine, b, 1)) / 32
                best[blocks, b] = min(best.get((blocks, b), 1e9), step)
    print(f"threads {args.threads}; 256-token prefill: blocks {prefill[True] * 1e3:.0f} ms, "
          f"oneDNN fp32 {prefill[False] * 1e3:.0f} ms")
    print("batch  blocks ms  fp32 ms  speed-up")
    for b in batches:
        print(f"{b:5d}  {best[True, b] * 1e3:9.1f}  {best[False, b] * 1e3:7.1f}  {best[False, b] / best[True, b]:7.2f}x")
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(8)]
    outs = {blocks: [o.token_ids for o in engine.generate(prompts, greedy)] for blocks, engine in engines.items()}
    same = sum(len(_common_prefix(a, b)) for a, b in zip(outs[True], outs[False]))
    print(f"greedy tokens before the first difference: {same} of {8 * 64}")


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


if __name__ == "__main__":
    main()
