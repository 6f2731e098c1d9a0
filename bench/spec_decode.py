"""Speculative decoding, n-gram prompt lookup and suffix decoding, against plain decoding on the default
model, in one run.

Workloads (issue 15): `repetitive` asks the chat model to repeat a given document with one edit (the
output copies long runs of the prompt, where prompt lookup shines); `random` gives prompts of random
token ids, sampled at temperature 1 with fixed seeds (drafts rarely match; adaptive speculation should
switch itself off; greedy, the small model would fall into loops that lookup predicts); `repeated` asks
the same support question (under another ticket number) that HISTORY earlier requests asked just before
(greedy; they run unmeasured before each side, so suffix decoding's global tree holds their outputs, as
in an agentic loop or a support queue). Each runs single stream and at batch 8, up to `--output-len` tokens. All
sides run on ONE engine (the same weights, warm-up and step-cost measurements), its speculator swapped
per side: the baseline's requests opt out (`speculative=False`), the others follow the engine's default
(adaptive, k = 4) with method ngram or suffix. Each suffix run has its own cache salt, so its global tree
holds only that run's history, never an earlier round's outputs. Each round runs every side (the order
reverses every other round) with the prefix cache reset before each, so all see the same machine load;
the ratios within a round are the numbers to trust.

Decode tokens/s counts the tokens after the first over the time from the first token to the last (the
whole batch's, at batch 8); ITL is the mean gap between a request's tokens (several tokens of one
verified draft arrive together, so ITL is the mean over tokens, not over steps). The outputs of all
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
from engine.spec_decode.speculator import Speculator  # noqa: E402

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


QUESTION = ("Ticket {ticket}. A customer asks: how do I reset my password on the website? Answer in five short "
            "numbered steps.")
HISTORY = 4  # earlier requests of the repeated task, run (unmeasured) before each side


def repeated_prompts(engine: Engine, n: int, offset: int = HISTORY) -> list[list[int]]:
    """The same support question under different ticket numbers: the answer is not in the prompt (prompt
    lookup has little to copy), but earlier tickets were answered alike."""
    return [engine.apply_chat_template([{"role": "user", "content": QUESTION.format(ticket=4711 + offset + i)}])
            for i in range(n)]


def random_prompts(engine: Engine, n: int, length: int = 128) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, engine.runner.vocab_size) for _ in range(length)] for _ in range(n)]


def use(engine: Engine, speculator: Speculator) -> None:
    engine.config.speculative_config, engine.speculator = speculator.config, speculator


def run(engine: Engine, prompts: list[list[int]], temperature: float, speculative: bool, output_len: int,
        history: list[list[int]]) -> dict:
    """Decode tokens/s and mean ITL of one batch (after the unmeasured `history` requests), and its outputs."""
    engine.block_manager.reset_prefix_cache()
    salt = f"run-{time.monotonic_ns()}"

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=i, max_tokens=output_len,
                              speculative=None if speculative else False)
    if history:
        for i, p in enumerate(history):
            engine.add_request(f"h-{salt}-{i}", p, params(i), cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        engine.block_manager.reset_prefix_cache()
    before = engine.speculator.stats.copy()
    reqs = [engine.add_request(f"{salt}-{i}", p, params(i), cache_salt=salt) for i, p in enumerate(prompts)]
    gaps: list[float] = []
    span = [None, None]  # the first and the last token's time, over every request
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
                span = [span[0] or now, now]
    tokens = sum(r.num_output_tokens - 1 for r in reqs)
    after = engine.speculator.stats
    return {"tokens_per_s": tokens / (span[1] - span[0]), "itl_ms": 1000 * statistics.mean(gaps),
            "outputs": [r.output_token_ids for r in reqs],
            "accepted": f"{after.num_accepted_tokens - before.num_accepted_tokens}/"
                        f"{after.num_draft_tokens - before.num_draft_tokens}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--workloads", default="repetitive,random,repeated")
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args()
    configs = {m: SpeculativeConfig(method=m, num_speculative_tokens=args.num_speculative_tokens)
               for m in ("ngram", "suffix")}
    engine = Engine(EngineConfig(model=args.model, speculative_config=configs["ngram"]))
    engine.warm_up()
    speculators = {"ngram": engine.speculator, "suffix": engine.new_speculator(configs["suffix"])}
    print(f"threads={torch.get_num_threads()} k={args.num_speculative_tokens} output_len={args.output_len}")
    print(f"{'workload':<11} {'batch':>5} {'round':>5} {'plain tok/s':>11} {'ngram':>6} {'suffix':>6} "
          f"{'ngram x':>7} {'suffix x':>8} {'plain ITL':>9} {'ngram ITL':>9} {'suffix ITL':>10} "
          f"{'ngram acc/draft':>15} {'suffix acc/draft':>16} {'same':>5}")
    workloads = {"repetitive": (repetitive_prompts, 0.0), "random": (random_prompts, 1.0),
                 "repeated": (repeated_prompts, 0.0)}
    for workload in args.workloads.split(","):
        make, temperature = workloads[workload]
        history = repeated_prompts(engine, HISTORY, offset=0) if workload == "repeated" else []
        for batch in map(int, args.batches.split(",")):
            prompts = make(engine, batch)
            for round_ in range(args.repeat):
                sides = ["plain", "ngram", "suffix"]
                results = {}
                for side in sides if round_ % 2 == 0 else sides[::-1]:
                    use(engine, speculators["suffix" if side == "suffix" else "ngram"])
                    results[side] = run(engine, prompts, temperature, side != "plain", args.output_len, history)
                accepted = {side: results[side]["accepted"] for side in sides}
                rate = {side: results[side]["tokens_per_s"] for side in sides}
                itl = {side: results[side]["itl_ms"] for side in sides}
                same = results["ngram"]["outputs"] == results["plain"]["outputs"] == results["suffix"]["outputs"]
                print(f"{workload:<11} {batch:>5} {round_:>5} {rate['plain']:>11.1f} {rate['ngram']:>6.1f} "
                      f"{rate['suffix']:>6.1f} {rate['ngram'] / rate['plain']:>7.2f} "
                      f"{rate['suffix'] / rate['plain']:>8.2f} {itl['plain']:>9.1f} {itl['ngram']:>9.1f} "
                      f"{itl['suffix']:>10.1f} {accepted['ngram']:>15} {accepted['suffix']:>16} {str(same):>5}")


if __name__ == "__main__":
    main()
