"""The CPU prefill attention kernel (engine/csrc/prefill_attention.c) against torch's fused SDPA, in the same
run: SmolLM2's heads (9 query, 3 KV, size 64), block size 16, whole prompts and chunks after a cached prefix,
as the model runner calls each (the kernel reads the blocks in place; SDPA gets them gathered and a mask);
2 queries over 1,536 is a short chunk of a local prefill beside streams, where laying out the context's keys
for the kernel's tiles is most of the call.
`.venv/bin/python bench/prefill_attention.py [threads]`"""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import cpu_kernels  # noqa: E402


def timed(fn, repeats: int = 20) -> float:
    fn(), fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    print(f"threads {torch.get_num_threads()}; ms per layer call, GFLOP/s of the kernel, kernel / SDPA")
    for dtype in (torch.bfloat16, torch.float32):
        for n_q, context in [(256, 256), (512, 512), (64, 1600), (16, 2048), (2, 1536)]:
            k_cache = torch.randn(400, block_size, kv_heads, dim).to(dtype)
            v_cache = torch.randn(400, block_size, kv_heads, dim).to(dtype)
            table = torch.arange(-(-context // block_size))
            q = torch.randn(n_q, heads + 2 * kv_heads, dim).to(dtype)[:, :heads]  # as the fused layer's QKV rows
            out = torch.empty(n_q, heads, dim, dtype=dtype)
            ours = timed(lambda: cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, table, context,
                                                                     dim ** -0.5))
            workspace = torch.empty(len(table), block_size, kv_heads, dim, dtype=dtype)
            q4 = q.transpose(0, 1).unsqueeze(0)
            mask = torch.ones(n_q, context, dtype=torch.bool).tril(context - n_q) if context > n_q else None

            def sdpa():
                k = torch.index_select(k_cache, 0, table, out=workspace).flatten(0, 1)[:context]
                k = k.transpose(0, 1).unsqueeze(0)
                v = torch.index_select(v_cache, 0, table, out=workspace).flatten(0, 1)[:context]
                v = v.transpose(0, 1).unsqueeze(0)
                return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, is_causal=mask is None,
                                                      scale=dim ** -0.5, enable_gqa=True)

            theirs = timed(sdpa)
            flops = 4 * n_q * context * heads * dim * (0.5 if context == n_q else 1.0)
            print(f"{str(dtype)[6:]:9s} {n_q:4d} queries over {context:5d}: kernel {ours:5.2f} ms "
                  f"({flops / ours / 1e6:5.1f} GFLOP/s), SDPA {theirs:5.2f} ms, {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
