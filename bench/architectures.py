"""Offline tokens/s of each architecture the engine runs (issue 42) against HF `generate`, in one run.

    .venv/bin/python bench/architectures.py --batch 8 --prompt-len 128 --output-len 64

Per architecture, a small random-weight model built from its HF config class (engine/model_loader.py
`build_random_model`, hidden 256, 4 layers; the windowed ones with a 64-token window, so prompts run past it),
fp32 on both sides: the engine's `generate` on --batch prompts of --prompt-len random tokens (greedy, --output-len
tokens each, ignore_eos) against HF `generate` on the same batch (one padded-free batch: the prompts have one
length; sdpa attention, eager where HF has no other (Gemma 2); its KV cache). Both sides run twice, the first run a warm-up; tokens/s counts generated
tokens over the whole call. The engine's outputs are checked against HF's (equal, or the first mismatch is
printed: random models have near-ties).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.stdout.reconfigure(line_buffering=True)
os.environ.setdefault("TANDEM_CPU_AUTO_DTYPE", "float32")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model_loader import build_random_model  # noqa: E402

SHAPE = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, max_position_embeddings=1024)
ARCHITECTURES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "mistral (window 64)": ("mistral", dict(sliding_window=64)),
    "gemma2 (window, soft-cap)": ("gemma2", dict(head_dim=32, sliding_window=64, attn_logit_softcapping=50.0,
                                                 final_logit_softcapping=30.0)),
    "gemma3 (window, QK-norm)": ("gemma3_text", dict(head_dim=32, sliding_window=64)),
    "phi3": ("phi3", {}),
    "mixtral (MoE)": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe (MoE)": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                          shared_expert_intermediate_size=256)),
}


def engine_rate(model_dir: str, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=1024, max_num_seqs=len(prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    return len(prompts) * output_len / (time.perf_counter() - started), [o.token_ids for o in outs]


@torch.inference_mode()
def hf_rate(model_dir: str, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError:  # Gemma 2 (soft-capping): HF has eager attention only
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids = torch.tensor(prompts)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
                  do_sample=False, pad_token_id=0)
    model.generate(ids, **kwargs)
    started = time.perf_counter()
    out = model.generate(ids, **kwargs)
    return len(prompts) * output_len / (time.perf_counter() - started), out[:, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--only", nargs="*", help="architectures to run (default: all)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="archs-"))
    print(f"| architecture | engine tok/s | HF generate tok/s | engine ÷ HF | outputs |\n|---|---|---|---|---|")
    for name, (arch, overrides) in ARCHITECTURES.items():
        if args.only and not any(o in name for o in args.only):
            continue
        model_dir = str(build_random_model(root / arch, arch, seed=3, **SHAPE, **overrides))
        rng = random.Random(0)
        prompts = [[rng.randrange(10, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        mine, ours = engine_rate(model_dir, prompts, args.output_len)
        theirs, hf = hf_rate(model_dir, prompts, args.output_len)
        same = sum(a == b for a, b in zip(ours, hf))
        print(f"| {name} | {mine:.0f} | {theirs:.0f} | {mine / theirs:.2f}x | {same}/{len(prompts)} equal |")


if __name__ == "__main__":
    main()
