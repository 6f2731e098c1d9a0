"""Prompt-block memory of n candidates on shared blocks against n separate requests (issue 14).

For each prompt length, one engine runs a request with n candidates (the prompt computed once, the
candidates forked from it) and a fresh engine runs n separate seeded requests of the same prompt added
together (what the ingress sent before issue 14). Both step until every candidate has its first token and
has written it into the KV cache (the copy-on-write step). Measured on the block manager: the blocks in
use then, the peak over those steps, and the prompt tokens the forwards computed. The figures do not
depend on the model's weights, so a tiny random Llama stands in.

Run: .venv/bin/python bench/n_shared_blocks.py
     .venv/bin/python bench/n_shared_blocks.py --n 8 --prompt-lens 100 300
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model_loader import build_random_model  # noqa: E402
from engine.sampling_params import candidate_seed  # noqa: E402
from engine.step_context import StepContext  # noqa: E402


def measure(model_dir: str, prompt: list[int], n: int, shared: bool) -> dict:
    """Blocks in use once every candidate wrote its first token, the peak until then, prompt tokens computed."""
    engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=4096))
    bm = engine.block_manager
    computed = [0]
    count = StepContext(on_scheduled=lambda scheduled: computed.__setitem__(0, computed[0] + sum(
        num for req, num in scheduled if req.num_computed_tokens < req.num_prompt_tokens)))
    if shared:
        engine.add_request("n", prompt, SamplingParams(n=n, seed=1, max_tokens=4, ignore_eos=True))
    else:
        for i in range(n):
            engine.add_request(f"r{i}", prompt, SamplingParams(seed=candidate_seed(1, i), max_tokens=4,
                                                               ignore_eos=True))
    tokens: dict[str, int] = {}
    peak = 0
    # Until every candidate has 2 tokens: its first one is then in the cache (written by the next forward).
    while len(tokens) < n or min(tokens.values()) < 2:
        for out in engine.step(count):
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    return {"in_use": bm.num_blocks - bm.num_free_blocks, "peak": peak, "prompt_tokens": computed[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[40, 200, 496])
    args = parser.parse_args()
    model_dir = str(build_random_model(Path(tempfile.mkdtemp()) / "tiny-llama", "llama", seed=0))
    print(f"n = {args.n}, block size 16; blocks in use once every candidate wrote its first token "
          f"(peak until then), prompt tokens computed")
    print(f"{'prompt':>7} | {'shared: blocks':>15} {'peak':>5} {'computed':>9} | "
          f"{'separate: blocks':>17} {'peak':>5} {'computed':>9} | {'prompt blocks':>13}")
    for length in args.prompt_lens:
        prompt = [5 + (i * 7919) % 40000 for i in range(length)]
        shared = measure(model_dir, prompt, args.n, shared=True)
        separate = measure(model_dir, prompt, args.n, shared=False)
        num_prompt_blocks = -(-length // 16)
        print(f"{length:>7} | {shared['in_use']:>15} {shared['peak']:>5} {shared['prompt_tokens']:>9} | "
              f"{separate['in_use']:>17} {separate['peak']:>5} {separate['prompt_tokens']:>9} | "
              f"{num_prompt_blocks:>13}")


if __name__ == "__main__":
    main()
