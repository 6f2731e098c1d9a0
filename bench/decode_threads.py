"""Decode step time by batch size on one and two threads, with and without bursty background processes (the
serving processes' wakeups): why `cpu.decode_borrows` is off by default on a machine without a spare core.

    .venv/bin/python bench/decode_threads.py                 # 1 and 2 threads, quiet
    .venv/bin/python bench/decode_threads.py --background 2  # with two processes each busy 2 ms of every 10 ms
    .venv/bin/python bench/decode_threads.py --dtype float32 --threads 1   # against the default (auto)

A step's time = (generate B 256-token prompts for 33 tokens - the same for 1 token) / 32, best of two; the
prefill is one 256-token prompt for one token, best of three.
"""
from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model_loader import default_model_dir  # noqa: E402


def bursty(busy_s: float = 0.002, period_s: float = 0.010) -> None:
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < busy_s:
            pass
        time.sleep(period_s - busy_s)


def step_times(threads: int, batches: list[int], dtype: str = "auto") -> tuple[float, dict[int, float]]:
    """(a 256-token prefill's seconds, batch -> decode step seconds)."""
    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=str(default_model_dir()), num_threads=threads, num_kv_blocks=1024,
                                 max_num_batched_tokens=4096, dtype=dtype))
    rng = random.Random(0)

    def run(batch: int, tokens: int) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(batch)]
        started = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - started

    run(2, 4)  # warm-up
    prefill = min(run(1, 1) for _ in range(3))
    return prefill, {b: min((run(b, 33) - run(b, 1)) / 32 for _ in range(2)) for b in batches}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--background", type=int, default=0, help="bursty processes to run meanwhile (unpinned)")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", default="1,2", help="thread counts to measure, e.g. 1")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    procs = [multiprocessing.Process(target=bursty, daemon=True) for _ in range(args.background)]
    for proc in procs:
        proc.start()
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            prefill, times = step_times(threads, batches, args.dtype)
            print(f"{args.dtype}, {threads} thread(s), {args.background} bursty: prefill 256 {prefill * 1000:.0f} ms; " +
                  ", ".join(f"batch {b} {s * 1000:.1f} ms" for b, s in times.items()), flush=True)
    finally:
        for proc in procs:
            proc.terminate()


if __name__ == "__main__":
    main()
