"""Speculative decoding (n-gram prompt lookup) against plain decoding on the default model, in one run.

Workloads (issue 15): `repetitive` asks the chat model to repeat a given document with one edit (the
output copies long runs of the prompt, where prompt lookup shines); `random` gives prompts of random
token ids, sampled at temperature 1 with fixed seeds (drafts rarely match; adaptive speculation should
switch itself off; greedy, the small model would fall into loops that lookup predicts). Each runs single
stream and at batch 8, up to `--output-len` tokens. Both sides run on ONE engine (the same weights, warm-up
and step-cost measurements): the baseline's requests opt out (`speculative=False`), the others follow the
engine's default (adaptive n-gram, k = 4). Each round runs both sides (which goes first alternates) with the
prefix cache reset before each, so both see the same machine load; the ratio within a round is the number to trust.

Decode tokens/s counts the tokens after the first over the time from the first token to the last (the
whole batch's, at batch 8); ITL is the mean gap between a request's tokens (several tokens of one
verified draft arrive together, so ITL is the mean over tokens, not over steps). The outputs of the two
sides are compared token for token (greedy, and seeded sampling too: each emitted token takes one draw).

Run: flock -w 1800 /tmp/tandem-bench.lock .venv/bin/python bench/spec_decode.py --repeat 2
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

import torch  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.spec_decode import SpeculativeConfig  # noqa: E402

DOCUMENT = """The harbour town of Ardmore sits at the mouth of a narrow river. Every morning the fishing boats
leave before sunrise and return in the early afternoon, when the market opens on the stone quay. The
lighthouse on the northern cliff was built in 1862 and still guides ships past the rocks. In summer the
town fills with visitors who walk the coastal path, swim in the cold bay and eat fried fish on the
harbour wall. In winter the storms close the road to the city for days at a time, and the people who
stay keep the library, the school and the small hospital running. The council plans a new sea wall to
protect the houses near the beach, but many residents fear it will spoil the view that brings the
visitors in the first place."""
INSTRUCTION = ("Repeat the following text exactly, word for word, but write 'Ardmore' in capital letters. "
               "Do not add anything.\n\n")


def repetitive_prompts(engine: Engine, n: int) -> list[list[int]]:
    """The document with a different ordering of its sentences per request, so each prompt is fresh."""
    sentences = DOCUMENT.replace("\n", " ").split(". ")
    prompts = []
    for i in range(n):
        rng = random.Random(i)
        doc = ". ".join(rng.sample(sentences, len(sentences))) if i else ". ".join(sentences)
        prompts.append(engine.apply_chat_template([{"role": "user", "content": INSTRUCTION + doc}]))
    return prompts


def random_prompts(engine: Engine, n: int, length: int = 128) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, engine.runner.vocab_size) for _ in range(length)] for _ in range(n)]


def run(engine: Engine, prompts: list[list[int]], temperature: float, speculative: bool, output_len: int) -> dict:
    """Decode tokens/s and mean ITL of one batch, and its outputs."""
    engine.block_manager.reset_prefix_cache()
    reqs = [engine.add_request(f"{'s' if speculative else 'p'}-{time.monotonic_ns()}-{i}", p, SamplingParams(
        temperature=temperature, seed=i, max_tokens=output_len, speculative=None if speculative else False))
            for i, p in enumerate(prompts)]
    gaps: list[float] = []
    seen = {r.request_id: (0, None) for r in reqs}
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        for r in reqs:
            count, last = seen[r.request_id]
            new = r.num_output_tokens - count
            if new and last is not None:
                gaps += [(now - last) / new] * new
            if new:
                seen[r.request_id] = (r.num_output_tokens, now)
    first = min(r.times.first_token for r in reqs)
    last = max(r.times.last_token for r in reqs)
    tokens = sum(r.num_output_tokens - 1 for r in reqs)
    return {"tokens_per_s": tokens / (last - first), "itl_ms": 1000 * statistics.mean(gaps),
            "outputs": [r.output_token_ids for r in reqs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, speculative_config=SpeculativeConfig(
        num_speculative_tokens=args.num_speculative_tokens)))
    engine.warm_up()
    print(f"threads={torch.get_num_threads()} k={args.num_speculative_tokens} output_len={args.output_len}")
    print(f"{'workload':<11} {'batch':>5} {'round':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'plain ITL':>9} {'spec ITL':>8} {'accepted/draft':>14} {'same':>5}")
    for workload, make, temperature in (("repetitive", repetitive_prompts, 0.0), ("random", random_prompts, 1.0)):
        for batch in (1, 8):
            prompts = make(engine, batch)
            for round_ in range(args.repeat):
                before = engine.speculator.stats.copy()
                if round_ % 2:  # alternate which side runs first
                    plain = run(engine, prompts, temperature, False, args.output_len)
                spec = run(engine, prompts, temperature, True, args.output_len)
                if not round_ % 2:
                    plain = run(engine, prompts, temperature, False, args.output_len)
                after = engine.speculator.stats
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                print(f"{workload:<11} {batch:>5} {round_:>5} {plain['tokens_per_s']:>11.1f} "
                      f"{spec['tokens_per_s']:>10.1f} {spec['tokens_per_s'] / plain['tokens_per_s']:>6.2f} "
                      f"{plain['itl_ms']:>9.1f} {spec['itl_ms']:>8.1f} {f'{accepted}/{drafted}':>14} "
                      f"{str(spec['outputs'] == plain['outputs']):>5}")


if __name__ == "__main__":
    main()
