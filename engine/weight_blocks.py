"""Finding the 4- and 8-bit blocks a model's fp32 weights were decoded from, and packing them for
`engine/csrc/block_linear.c`.

The default SmolLM2 ships as a GGUF file of Q4_1 blocks (its token embedding, tied to the LM head, as
Q8_0); transformers decodes them to fp32 at load time, so every weight is exactly d * q + m (Q4_1) or
d * q (Q8_0) for one fp16 d (and m) per 32 weights of a row. A weight matrix for which that holds is found
again from the fp32 values alone (`pack_blocks` in the kernel's C file: 0.39 s for all of SmolLM2), without
the GGUF file and whatever row order transformers gave the layer, and checked weight by weight: a matrix
with a single value off is not packed. So a model whose weights were never blocks (every HF checkpoint in
bf16 or fp32, every test's random model) keeps its dense linears, and a packed one computes with exactly
the weights it loaded.
"""
from __future__ import annotations

import torch

from engine import cpu_kernels

Q4_1, Q8_0 = 0, 1
BLOCK = 32  # weights per block, along a row (the input dimension)
TILE = 16   # outputs per packed tile (one AVX-512 register of fp32)
PAIR = 2 * TILE  # the kernel computes two tiles at a time


RECORD_BYTES = {Q4_1: 320, Q8_0: 544}  # per tile and block (engine/csrc/block_linear.c)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The weight [out, in] as packed Q4_1 or Q8_0 records and its kind, or None if it is not exactly
    one of those (or not fp32, or its shape does not tile: out % 32, in % 32, or the kernel does not run
    here). The check stops at the first block that is not exact: dense weights fail in their first row."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or not cpu_kernels.blocks_available():
        return None
    n, k = weight.shape
    if n % PAIR or k % BLOCK or n == 0:
        return None
    weight = weight.detach().contiguous()
    for kind in (Q4_1, Q8_0):
        packed = torch.empty(n // TILE, k // BLOCK, RECORD_BYTES[kind], dtype=torch.uint8)
        if cpu_kernels.pack_blocks(packed, weight, kind):
            return packed, kind
    return None


def unpack(packed: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """The fp32 weight [n, k] a packed tensor holds (for tests and checks)."""
    tiles, nblocks = n // TILE, k // BLOCK
    rec = packed.reshape(tiles, nblocks, -1)
    d = rec[..., :2 * TILE].contiguous().view(torch.float16).float()  # [tiles, blocks, TILE]
    if kind == Q4_1:
        m = rec[..., 2 * TILE:4 * TILE].contiguous().view(torch.float16).float()
        nib = rec[..., 4 * TILE:].reshape(tiles, nblocks, BLOCK // 2, TILE)
        q = torch.stack([nib & 15, nib >> 4], -1).permute(0, 1, 3, 2, 4).reshape(tiles, nblocks, TILE, BLOCK)
        w = q.float() * d.unsqueeze(-1) + m.unsqueeze(-1)
    else:
        q = rec[..., 2 * TILE:].contiguous().view(torch.int8).reshape(tiles, nblocks, BLOCK, TILE).permute(0, 1, 3, 2)
        w = q.float() * d.unsqueeze(-1)
    return w.permute(0, 2, 1, 3).reshape(n, k)
