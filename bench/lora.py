"""LoRA decode cost (issue 42): a decode batch of 16 mixing 4 adapters against the base model's batch of 16, on
the default model, in one run.

Four random rank-`--rank` PEFT adapters on every attention and MLP projection of SmolLM2-135M (built once under
the tandem cache dir; needs `peft`, a dev dependency). Sides, each on the README's default dtype (bf16 where the
CPU multiplies it natively), all in one process so they see the same machine:
  base         an engine without LoRA, 16 base-model requests (the baseline)
  base+lora    an engine with LoRA enabled (max_loras=4), the same 16 base-model requests (what enabling costs
               requests that name no adapter)
  4 adapters   the LoRA engine, 16 requests, 4 per adapter, in one batch
  1 adapter    the LoRA engine, 16 requests of one adapter
Each request: a `--prompt-len`-token random prompt, `--output-len` tokens, greedy, ignore_eos. Decode tokens/s
counts the tokens after each request's first over the time from the batch's last first token to its last token
(pure decode steps of 16). Rounds alternate the order of the sides; ratios within a round are the numbers to trust.

Run: flock -w 1800 /tmp/tandem-bench.lock .venv/bin/python bench/lora.py --rounds 3
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.stdout.reconfigure(line_buffering=True)

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.lora import build_random_adapter  # noqa: E402
from engine.lora_request import LoRARequest  # noqa: E402
from engine.model_loader import cache_dir, default_model_dir  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapters(rank: int, count: int) -> list[LoRARequest]:
    base = default_model_dir()
    root = cache_dir() / "bench-lora"
    return [LoRARequest.from_dir(f"bench-{rank}-{i}", build_random_adapter(
        base, root / f"r{rank}-{i}", seed=100 + i, rank=rank, alpha=2.0 * rank, target_modules=TARGETS,
        scale=0.02)) for i in range(count)]


def decode_rate(engine: Engine, loras: list[LoRARequest | None], prompt_len: int, output_len: int,
                seed: int) -> float:
    """Decode tokens/s of one batch, request i running loras[i]."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, lora in enumerate(loras):
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        engine.add_request(f"r{seed}-{i}", prompt, params, lora=lora)
    started = None
    counted = 0
    firsts = set()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in firsts:
                firsts.add(out.request_id)
                continue
            if started is not None:
                counted += len(out.new_token_ids)
        if started is None and len(firsts) == len(loras):
            started = now
    return counted / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    loaded = adapters(args.rank, 4)
    plain = Engine(EngineConfig(num_kv_blocks=1024, max_num_seqs=args.batch))
    with_lora = Engine(EngineConfig(num_kv_blocks=1024, max_num_seqs=args.batch, enable_lora=True, max_loras=4,
                                    max_lora_rank=args.rank))
    print(f"dtype {plain.config.resolved_dtype}, batch {args.batch}, rank {args.rank}, LoRA weights "
          f"{with_lora.runner.lora.weight_bytes / 2**20:.1f} MiB in {len(with_lora.runner.lora.wrappers)} wrappers")
    b = args.batch
    sides = {"base": (plain, [None] * b), "base+lora": (with_lora, [None] * b),
             "4 adapters": (with_lora, [loaded[i % 4] for i in range(b)]),
             "1 adapter": (with_lora, [loaded[0]] * b)}
    for engine, loras in sides.values():  # warm up: first steps, adapter loads
        decode_rate(engine, loras, args.prompt_len, 8, seed=0)
    rates = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            engine, loras = sides[name]
            rates[name].append(decode_rate(engine, loras, args.prompt_len, args.output_len, seed=1 + r))
        print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:.0f} tok/s ({rates[n][-1] / rates['base'][-1]:.2f}x)"
                                         for n in sides))
    print("median ratio to base: " + ", ".join(
        f"{n} {statistics.median(x / y for x, y in zip(rates[n], rates['base'])):.2f}x" for n in sides))


if __name__ == "__main__":
    main()
