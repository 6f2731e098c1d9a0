"""A 256-token prefill of the default model on the bare engine with attention on the C prefill kernel and on
torch's SDPA, interleaved in one process (3 rounds of 3 each), so the box's drift falls on both alike.
`.venv/bin/python bench/prefill_kernel_ab.py [threads] [float32|bfloat16]`"""
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
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=str(default_model_dir()), num_threads=threads, num_kv_blocks=512,
                                 max_num_batched_tokens=2048, dtype=dtype))
    rng = random.Random(0)

    def one() -> float:
        ids = [rng.randrange(100, 40000) for _ in range(256)]
        started = time.perf_counter()
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        return (time.perf_counter() - started) * 1e3

    times: dict[str, list[float]] = {"kernel": [], "SDPA": []}
    for _ in range(3):
        for name, on in (("kernel", True), ("SDPA", False)):
            engine.runner.prefill_kernel = on
            one()
            times[name] += [one() for _ in range(3)]
    for name, values in times.items():
        values.sort()
        print(f"{dtype}, {threads} thread(s), attention on {name}: median {values[len(values) // 2]:.0f} ms "
              f"({', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
