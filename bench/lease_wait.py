"""How long a peer's prefix lease waits on a busy worker: the lease (BlockManager.hold_prefix) submitted to the
engine loop while it runs long prefill steps, as a plain command (it waits for the step's end) and as a
between-layers command (worker_runtime/engine_loop.py: it runs before the forward's next decoder layer).

    .venv/bin/python bench/lease_wait.py [--prompt-len 2048] [--leases 20] [--dtype auto]

The default model (SmolLM2-135M); both kinds alternate at random moments of the same steps.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.hashing import block_hashes  # noqa: E402
from worker_runtime.engine_loop import EngineLoop  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--leases", type=int, default=20, help="per kind")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(dtype=args.dtype, max_num_batched_tokens=args.prompt_len,
                                 max_model_len=args.prompt_len + 64))
    bs = engine.config.block_size
    prefix = list(range(1000, 1000 + 8 * bs))  # 8 blocks a peer leases
    engine.generate([prefix + [7]], SamplingParams(temperature=0.0, max_tokens=1))
    chain = block_hashes(prefix, bs)
    loop = EngineLoop(engine)
    rng = random.Random(args.seed)
    waits: dict[bool, list[float]] = {False: [], True: []}
    steps: list[float] = []
    loop.on_step = lambda outputs, last=[time.monotonic()]: (steps.append(time.monotonic() - last[0]),
                                                            last.__setitem__(0, time.monotonic()))
    busy = threading.Event()

    def feed(i: int) -> None:  # keep the loop in long prefill steps: one prompt a step, never cached
        req = engine.make_request(f"p{i}", [rng.randrange(2000, 40000) for _ in range(args.prompt_len)],
                                  SamplingParams(temperature=0.0, max_tokens=1))
        loop.submit(engine.add, req)

    for i in range(4):
        feed(i)
    busy.set()
    kinds = [False, True] * args.leases
    rng.shuffle(kinds)
    for n, between in enumerate(kinds):
        feed(100 + n)
        time.sleep(rng.uniform(0.05, 0.6))  # somewhere in a step
        started = time.monotonic()
        held = loop.submit(engine.block_manager.hold_prefix, chain, prefix, between_layers=between).result(120)
        waits[between].append(time.monotonic() - started)
        loop.submit(engine.block_manager.free_block_ids, held)
    loop.stop()
    step_ms = statistics.median(steps[1:]) * 1000
    print(f"prefill step of {args.prompt_len} tokens: median {step_ms:.0f} ms")
    for between, label in ((False, "after the step"), (True, "between layers")):
        w = sorted(x * 1000 for x in waits[between])
        print(f"lease {label:15s}: p50 {statistics.median(w):7.1f} ms  p90 {w[int(0.9 * (len(w) - 1))]:7.1f} ms  "
              f"max {w[-1]:7.1f} ms  ({len(w)} leases)")


if __name__ == "__main__":
    main()
