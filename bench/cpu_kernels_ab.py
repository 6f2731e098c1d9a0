"""The CPU path's C kernels against their alternatives, each arm in a fresh process on one pinned core,
arms alternated over rounds (the box is shared and noisy: compare arms within one run, not across runs).

    .venv/bin/python bench/cpu_kernels_ab.py                              # fused layers vs HF layers
    .venv/bin/python bench/cpu_kernels_ab.py --arms fused,avx2,no-kernels --dtype float32
    .venv/bin/python bench/cpu_kernels_ab.py --arms fused,baseline --baseline-src /tmp/old_csrc

Arms:
    fused       the defaults: fused decoder layers, C paged decode attention, the widest vectors the CPU has
    hf-layers   HF's decoder layers (the C paged attention stays)
    avx2        the kernels built for AVX2/FMA only (what CPUs without AVX-512 get)
    no-kernels  no C kernels at all (TANDEM_CPU_KERNELS=0: HF layers, gather + SDPA decode attention)
    baseline    the kernels built from the sources in --baseline-src (e.g. `git show REV:engine/csrc/X.c`
                saved there, every .c and .h of engine/csrc), to measure a kernel change

A step's time = (generate B 256-token prompts for 17 tokens - the same for 1 token) / 16; the prefill is one
256-token prompt for one token; each the best over the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("fused", "hf-layers", "avx2", "no-kernels", "baseline")


def measure(arm: str, dtype: str, batches: list[int], baseline_src: str | None) -> dict:
    """Runs in the arm's own process: set the arm up, build an engine, time a prefill and decode steps."""
    sys.path.insert(0, str(ROOT))
    import torch

    from engine import cpu_kernels
    from engine import model_runner

    if arm == "hf-layers":
        model_runner.fuse_decoder_layers = lambda model: 0
    elif arm == "avx2":
        cpu_kernels._arch_flags = lambda: ["-mavx2", "-mfma"]
    elif arm == "baseline":
        cpu_kernels.CSRC = Path(baseline_src)
    from engine import Engine, EngineConfig, SamplingParams
    from engine.model_loader import default_model_dir

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(default_model_dir()), num_threads=1, num_kv_blocks=1024,
                                 max_num_batched_tokens=4096, dtype=dtype))
    rng = random.Random(0)

    def run(batch: int, tokens: int) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        started = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - started

    run(2, 4)  # warm-up: oneDNN primitives, kernel builds
    result = {"prefill": run(1, 1)}
    for batch in batches:
        result[str(batch)] = (run(batch, 17) - run(batch, 1)) / 16
    result["fused_layers"] = engine.runner.fused_layers
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="fused,hf-layers", help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--core", type=int, default=0, help="the core every arm is pinned to")
    p.add_argument("--baseline-src", help="directory with the baseline arm's kernel sources")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",") if b]
    if not batches or min(batches) < 1:
        p.error("--batches takes positive batch sizes, e.g. 1,4,16")
    if a.child:
        print(json.dumps(measure(a.child, a.dtype, batches, a.baseline_src)))
        return 0
    arms = [arm for arm in a.arms.split(",") if arm]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown or not arms:
        p.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if "baseline" in arms and not (a.baseline_src and Path(a.baseline_src, "paged_attention.c").is_file()):
        p.error("the baseline arm needs --baseline-src with the kernel sources (paged_attention.c, fused_ops.c, ...)")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.core not in os.sched_getaffinity(0):
        p.error(f"core {a.core} is not among this process's cores {sorted(os.sched_getaffinity(0))}")
    best: dict[str, dict[str, float]] = {arm: {} for arm in arms}
    for round_ in range(a.rounds):
        for arm in arms:
            cmd = [sys.executable, __file__, "--child", arm, "--dtype", a.dtype, "--batches", a.batches]
            if a.baseline_src:
                cmd += ["--baseline-src", a.baseline_src]
            env = dict(os.environ, **({"TANDEM_CPU_KERNELS": "0"} if arm == "no-kernels" else {}))
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                                 preexec_fn=lambda: os.sched_setaffinity(0, {a.core}))
            result = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {round_ + 1} {arm:10s} " + "  ".join(
                f"{k}: {v * 1000:.1f} ms" for k, v in result.items() if k != "fused_layers")
                + f"  (fused layers: {result['fused_layers']})", flush=True)
            for key, value in result.items():
                if key != "fused_layers":
                    best[arm][key] = min(best[arm].get(key, value), value)
    print(f"\nbest of {a.rounds}, {a.dtype}, one thread on core {a.core}:")
    print("| arm | 256-token prefill | " + " | ".join(f"decode step, batch {b}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for arm in arms:
        row = [best[arm]["prefill"]] + [best[arm][str(b)] for b in batches]
        print(f"| {arm} | " + " | ".join(f"{v * 1000:.1f} ms" for v in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
