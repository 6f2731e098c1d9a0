"""One 256-token prefill of the default model on the bare engine, one thread: its time and a torch.profiler
table of where it goes. `.venv/bin/python bench/prefill_profile.py [threads] [cached] [sdpa]`: with `cached` > 0, a
64-token prefill after that many cached prompt tokens (a prefix hit) instead; with `sdpa`, attention runs on torch's
fused SDPA instead of the C prefill kernel (the baseline of engine/csrc/prefill_attention.c)."""
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model_loader import default_model_dir  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
engine = Engine(EngineConfig(model=str(default_model_dir()), num_threads=threads, num_kv_blocks=512,
                             max_num_batched_tokens=2048))
rng = random.Random(0)
if "sdpa" in sys.argv[3:]:
    engine.runner.prefill_kernel = False


cached = int(sys.argv[2]) if len(sys.argv) > 2 else 0
prefix = [rng.randrange(100, 40000) for _ in range(cached)]
if cached:
    engine.generate([prefix + [5]], SamplingParams(temperature=0, max_tokens=1))


def one() -> float:
    # fresh prompts: no prefix hits but the cached prefix
    ids = prefix + [rng.randrange(100, 40000) for _ in range(64 if cached else 256)]
    started = time.perf_counter()
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - started


for _ in range(3):
    one()
attention = "SDPA" if not engine.runner.prefill_kernel else "the C prefill kernel"
print(f"{'64-token prefill after %d cached' % cached if cached else '256-token prefill'}, {threads} thread(s), "
      f"attention on {attention}:", [round(one() * 1e3) for _ in range(5)], "ms")
with profile(activities=[ProfilerActivity.CPU]) as prof:
    one()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
