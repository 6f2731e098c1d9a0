"""Offline throughput and decode latency of the engine against HF transformers `generate`, in one run.

Workload (issue 2): N requests of random prompt ids, greedy, exactly `--output-len` output tokens
(min_tokens = max_tokens, so EOS is never sampled, as with HF's min_new_tokens). The engine runs
them as one continuous batch; HF runs them as one static left-padded batch (`generate` with
max_new_tokens = min_new_tokens, do_sample=False, its default sdpa attention). Single-request
decode latency is the mean gap between tokens of one request on an otherwise idle engine, and the
same gap in HF (timed with a streamer). Rounds alternate engine and HF on fresh prompts, so both
see the same machine load; the ratio within a round is the number to trust on a shared machine.
"cpu s" is the process CPU time of the batch.

Run: .venv/bin/python bench/offline.py --repeat 3
     .venv/bin/python bench/offline.py --num-requests 32 --prompt-len 128 --output-len 128 --skip-hf
     .venv/bin/python bench/offline.py --profile /tmp/engine.json   (torch.profiler trace of the engine batch)
     python3 bench/offline.py --device cuda --dtype bfloat16 --model DIR   (both sides on the GPU; bench/gpu_check.sh)
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.stdout.reconfigure(line_buffering=True)

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model_loader import resolve_model_dir  # noqa: E402


@dataclass(slots=True)
class Result:
    name: str
    num_output_tokens: int
    wall_s: float
    cpu_s: float
    decode_ms: float | None
    token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def timed(fn):
    """(wall seconds, process CPU seconds, result) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


# ---- engine -------------------------------------------------------------------------------------

def run_engine(engine: Engine, prompts, single, args, profile: str | None) -> Result:
    # min_tokens = max_tokens bans EOS for the whole output, exactly as HF's min_new_tokens does
    # (with ignore_eos, vLLM semantics would let EOS be sampled and the outputs would differ).
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            wall, cpu, outs = timed(lambda: engine.generate(prompts, params))
        prof.export_chrome_trace(profile)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    else:
        wall, cpu, outs = timed(lambda: engine.generate(prompts, params))
    ms = None if args.skip_single else engine_single_decode_ms(engine, single, params)
    return Result("engine", len(prompts) * args.output_len, wall, cpu, ms, [o.token_ids for o in outs])


def engine_single_decode_ms(engine: Engine, prompt: list[int], params: SamplingParams) -> float:
    """Mean time between consecutive tokens of one request (TPOT), in ms."""
    engine.add_request("single", prompt, params)
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


# ---- HF transformers ----------------------------------------------------------------------------

class _TokenClock:
    """A generate() streamer that only records when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


@torch.inference_mode()
def hf_generate(model, prompts, output_len: int, streamer=None) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    pad = model.generation_config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                         do_sample=False, pad_token_id=pad, streamer=streamer)
    return out[:, width:].tolist()


def run_hf(model, prompts, single, args) -> Result:
    wall, cpu, tokens = timed(lambda: hf_generate(model, prompts, args.output_len))
    ms = None
    if not args.skip_single:
        clock = _TokenClock()
        hf_generate(model, [single], args.output_len, streamer=clock)
        stamps = clock.stamps[1:]
        ms = 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return Result("hf generate", len(prompts) * args.output_len, wall, cpu, ms, tokens)


# ---- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="both sides' device (auto: CUDA when present)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="both sides' precision (the engine's `auto` is bfloat16 on CPUs with AMX/AVX512-BF16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="rounds, engine and HF alternating (new prompts each)")
    ap.add_argument("--skip-hf", action="store_true", help="only run the engine")
    ap.add_argument("--skip-single", action="store_true", help="skip single-request decode latency")
    ap.add_argument("--profile", metavar="TRACE.json", help="profile the engine batch of round 1 with torch.profiler")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    # HF runs every request as one batch: so does the engine (its default admits 64 sequences at a time).
    engine = Engine(EngineConfig(model=args.model, num_threads=args.threads, dtype=args.dtype, device=args.device,
                                 max_num_seqs=max(64, args.num_requests)))
    device = engine.runner.device
    vocab = engine.runner.vocab_size
    warmup = make_prompts(4, args.prompt_len, vocab, args.seed + 1000)
    engine.generate(warmup, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=getattr(torch, args.dtype))
        model = model.to(device).eval()
        hf_generate(model, warmup, 8)

    print(f"{args.num_requests} requests x {args.prompt_len} prompt x {args.output_len} output tokens, "
          f"greedy {args.dtype} on {device}, {args.threads} threads, torch {torch.__version__}")
    print(f"{'round':<6} {'':<12} {'output tok/s':>12} {'wall s':>8} {'cpu s':>8} {'1-req decode ms/tok':>20}")
    ratios = []
    for r in range(args.repeat):
        # Fresh prompts every round, so the engine's prefix cache never helps it.
        prompts = make_prompts(args.num_requests, args.prompt_len, vocab, args.seed + 2 * r)
        single = make_prompts(1, args.prompt_len, vocab, args.seed + 2 * r + 1)[0]
        results = [run_engine(engine, prompts, single, args, args.profile if r == 0 else None)]
        if model is not None:
            results.append(run_hf(model, prompts, single, args))
        for res in results:
            ms = "-" if res.decode_ms is None else f"{res.decode_ms:.2f}"
            print(f"{r + 1:<6} {res.name:<12} {res.tokens_per_s:>12.1f} {res.wall_s:>8.2f} {res.cpu_s:>8.2f} {ms:>20}")
        if model is not None:
            ours, hf = results
            ratios.append(ours.tokens_per_s / hf.tokens_per_s)
            line = f"       engine/hf throughput {ratios[-1]:.2f}x (by cpu s {hf.cpu_s / ours.cpu_s:.2f}x)"
            if ours.decode_ms is not None:
                line += f", hf/engine 1-req ms/token {hf.decode_ms / ours.decode_ms:.2f}x"
            same = sum(a == b for a, b in zip(ours.token_ids, hf.token_ids))
            print(line + f", greedy outputs identical to hf: {same}/{len(prompts)}")
    if len(ratios) > 1:
        print(f"engine/hf throughput over {len(ratios)} rounds: median {statistics.median(ratios):.2f}x, "
              f"min {min(ratios):.2f}x, max {max(ratios):.2f}x")


if __name__ == "__main__":
    main()
