"""Where one decode step of a full batch spends its time: the engine's host work (cProfile) and its
operators (torch.profiler, CPU and, on a GPU, CUDA activity), on a model of SmolLM2-135M's shape with
random weights.

N requests are prefilled, then `--steps` decode steps are timed one by one (synchronized on a GPU),
profiled with cProfile, then with torch.profiler. Prints ms per step, the cProfile top by own time and
cumulative time, and the operator table, so the host share of a step (Python between kernels) can be
read off against the device share.

Run: .venv/bin/python bench/step_profile.py --num-requests 64 --device cpu
     python3 bench/step_profile.py --device cuda --dtype bfloat16 --num-requests 256   (bench/gpu_check.sh)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.model_loader import build_random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--model-dir", default="/tmp/tandem-step-profile-model")
    ap.add_argument("--trace", help="also write a chrome trace of the profiled steps here")
    args = ap.parse_args()
    model = build_random_model(args.model_dir, "llama", seed=0, hidden_size=576, num_layers=args.layers,
                               num_heads=9, num_kv_heads=3, max_position_embeddings=2048)
    engine = Engine(EngineConfig(model=str(model), max_num_seqs=args.num_requests, dtype=args.dtype,
                                 device=args.device, num_kv_blocks=args.num_requests * (args.prompt_len // 16 + 8)))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rng = random.Random(0)
    vocab = engine.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    for i in range(args.num_requests):
        engine.add_request(str(i), [rng.randrange(3, vocab) for _ in range(args.prompt_len)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    sync()

    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    times.sort()
    print(f"{args.num_requests} sequences, {args.dtype} on {args.device}: decode step "
          f"median {times[len(times) // 2]:.1f} ms, min {times[0]:.1f} ms")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    sync()
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(30)
        print(f"---- cProfile by {key} ({args.steps} steps)\n" + out.getvalue().split("\n", 6)[-1])

    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as tprof:
        for _ in range(args.steps):
            engine.step()
        sync()
    print(f"---- torch.profiler ({args.steps} steps)")
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    if args.device == "cuda":
        print(tprof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    if args.trace:
        tprof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
