"""Issue 40's step figure: a decode step with tensor parallelism (TP=2, one core per rank) against TP=1 on the same
cores, at batch 1 / 8 / 32, on a random-weight model of the default model's size whose heads split in two.

SmolLM2-135M's 9 query / 3 KV heads do not divide by 2 (the engine refuses it, naming the numbers), so the model is
SmolLM2's shape with 12 heads of 48 (hidden 576, 4 KV heads, MLP 1536, 30 layers, vocabulary 49,152). Each arm is a
fresh offline Engine (TP=1 with --threads torch threads, TP=2 with --threads split between its ranks); per batch it
prefills B random --prompt-len prompts, then times --steps decode steps with every request decoding. Arms
alternate per --repeat round, so both see the same machine load; the ratio within a round is the number to trust.

    .venv/bin/python bench/tp_step.py                    # ~3 min on 2 cores
    .venv/bin/python bench/tp_step.py --batches 1,8 --repeat 3 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.stdout.reconfigure(line_buffering=True)

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model_loader import build_random_model  # noqa: E402

SHAPE = dict(hidden_size=576, num_layers=30, num_heads=12, num_kv_heads=4, intermediate_size=1536,
             max_position_embeddings=2048, tie_word_embeddings=True)


def decode_steps(engine: Engine, batch: int, prompt_len: int, steps: int, seed: int) -> list[float]:
    """Seconds per decode step with `batch` requests all decoding."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{seed}-{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()  # the first all-decode step
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the raw step times here")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    model = build_random_model(Path(tempfile.gettempdir()) / "tandem-tp-step-model", "llama", seed=0, **SHAPE)
    medians: dict[tuple[int, int], list[float]] = {}
    for round_ in range(args.repeat):
        for tp in (1, 2):
            engine = Engine(EngineConfig(model=str(model), dtype=args.dtype, tensor_parallel_size=tp,
                                         num_threads=args.threads, kv_cache_memory_gb=0.5))
            try:
                for batch in batches:
                    times = decode_steps(engine, batch, args.prompt_len, args.steps, args.seed + round_)
                    medians.setdefault((tp, batch), []).append(statistics.median(times))
                    print(f"round {round_} TP={tp} batch {batch}: median step {1e3 * medians[tp, batch][-1]:.1f} ms")
            finally:
                engine.close()
    print(f"\n{args.dtype}, {args.threads} threads in all, prompt {args.prompt_len}, {args.steps} steps a batch, "
          f"{args.repeat} rounds")
    print("| batch | TP=1 step (ms) | TP=2 step (ms) | TP=1 / TP=2 (speed of TP=2) per round |")
    print("|---|---|---|---|")
    for batch in batches:
        one, two = medians[1, batch], medians[2, batch]
        ratios = " / ".join(f"{a / b:.2f}" for a, b in zip(one, two))
        print(f"| {batch} | {1e3 * statistics.median(one):.1f} | {1e3 * statistics.median(two):.1f} | {ratios} |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"tp{t}-b{b}": v for (t, b), v in medians.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
