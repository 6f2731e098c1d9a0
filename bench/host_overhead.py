"""The engine's host work per token: `engine.generate` on a tiny random model with a full vocabulary, where
the forward costs little and what the engine does per token in Python (scheduling, sampling, detokenizing)
sets the pace, as it does on a GPU. Compare two checkouts in one run by alternating:

    for i in 1 2 3; do for dir in /tmp/base /work/main; do
        (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python /work/main/bench/host_overhead.py); done; done

Prints output tok/s per workload: greedy with min_tokens = max_tokens (bench/offline.py's), greedy with
ignore_eos (the serving benchmarks'), and seeded sampling at temperature 0.8.
"""
from __future__ import annotations

import argparse
import random
import time

from engine import Engine, EngineConfig, SamplingParams
from engine.model_loader import build_random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model-dir", default="/tmp/tandem-host-overhead-model")
    args = ap.parse_args()
    model = build_random_model(args.model_dir, "llama", seed=0)
    engine = Engine(EngineConfig(model=str(model), num_kv_blocks=4096, max_num_seqs=args.num_requests,
                                 dtype="float32", device="cpu"))
    rng = random.Random(0)
    vocab = engine.runner.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(n)]

    engine.generate(prompts(8), SamplingParams(temperature=0.0, max_tokens=8))
    n = args.output_len
    workloads = {
        "greedy, min_tokens = max_tokens": SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n),
        "greedy, ignore_eos": SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        "seeded, temperature 0.8": SamplingParams(temperature=0.8, seed=1, max_tokens=n, ignore_eos=True),
    }
    for name, params in workloads.items():
        batch = prompts(args.num_requests)
        start = time.perf_counter()
        engine.generate(batch, params)
        print(f"{name:34s} {args.num_requests * n / (time.perf_counter() - start):8.0f} tok/s")


if __name__ == "__main__":
    main()
