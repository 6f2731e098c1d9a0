"""How a decode worker's chunked local prefill beside running streams goes: the chunk each step carries, what
the step took, and the prefill speed its step costs learn from those steps (engine/step_costs.py), over a few
prompts in a row, each a short suffix after a long cached prefix (the shared-prefix mix's hits), on one engine.

The step costs size each chunk (`prefill_budget`: the room a step has within the ITL SLO and `stall_ratio` plain
decode steps, at the speed measured for that context); the speed they measure from those very steps sizes the
next chunks. A bias in that measure shows as chunks that shrink from prompt to prompt while the step has room.

Run: .venv/bin/python bench/local_chunks.py                         (SmolLM2, bf16, one thread, 10 streams)
     .venv/bin/python bench/local_chunks.py --decodes 16 --prefix-len 1024 --rounds 6 --dtype float32
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine import step_costs  # noqa: E402
from engine.model_loader import resolve_model_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a HF model directory (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--decodes", type=int, default=10, help="streams decoding beside the prompts")
    p.add_argument("--prefix-len", type=int, default=1536)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="prompts, one after another")
    p.add_argument("--itl-slo-ms", type=float, default=250.0)
    p.add_argument("--seed", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    steps: list[tuple[int, int, int, float, float]] = []
    observe = step_costs.StepCosts.observe

    def recording(self, num_decodes, prefill_tokens, prefill_context, seconds, borrowed=False):
        if prefill_tokens and num_decodes:
            steps.append((num_decodes, prefill_tokens, prefill_context, seconds, self.decode_time(num_decodes)))
        return observe(self, num_decodes, prefill_tokens, prefill_context, seconds, borrowed)
    step_costs.StepCosts.observe = recording

    engine = Engine(EngineConfig(model=str(resolve_model_dir(args.model)), dtype=args.dtype,
                                 itl_slo_ms=args.itl_slo_ms))
    engine.warm_up()
    rng = random.Random(args.seed)
    vocab = engine.runner.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = tokens(args.prefix_len)
    engine.generate([prefix + tokens(args.suffix_len)], SamplingParams(max_tokens=1))  # cache the prefix
    long = SamplingParams(max_tokens=4000, min_tokens=4000, temperature=0.0)  # outlasts the rounds
    for i in range(args.decodes):
        engine.add_request(f"stream-{i}", tokens(256), long)
    while engine.stats()["queued_prefill_tokens"]:
        engine.step()
    for _ in range(20):
        engine.step()
    costs = engine.stats()["step_costs"]
    bucket = step_costs.bucket(args.prefix_len + args.suffix_len)
    print(f"{args.decodes} streams, decode step {costs.decode_time(args.decodes) * 1000:.0f} ms; "
          f"prefill speed at context bucket {bucket}: {costs.prefill_speed(bucket):.0f} tok/s (whole prompts)")
    print("| prompt | TTFT | steps | chunks (tokens) | step ms | speed learnt |")
    print("|---|---|---|---|---|---|")
    for r in range(args.rounds):
        steps.clear()
        rid = f"hit-{r}"
        engine.add_request(rid, prefix + tokens(args.suffix_len), SamplingParams(max_tokens=1))
        started = time.perf_counter()
        while not any(out.request_id == rid for out in engine.step()):
            pass
        ttft = time.perf_counter() - started
        speed = engine.stats()["step_costs"].prefill_speed(bucket)
        print(f"| {r + 1} | {ttft * 1000:.0f} ms | {len(steps)} | {', '.join(str(s[1]) for s in steps)} | "
              f"{', '.join(f'{s[3] * 1000:.0f}' for s in steps)} | {speed:.0f} tok/s |")
    limit = costs.step_limit(args.decodes, args.itl_slo_ms / 1000, engine.config.stall_ratio)
    print(f"step limit beside {args.decodes} streams: {limit * 1000:.0f} ms")


if __name__ == "__main__":
    main()
