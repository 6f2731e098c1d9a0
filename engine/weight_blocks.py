"""Finding the 4- and 8-bit blocks a model's fp32 weights were decoded from, and packing them for
`engine/csrc/block_linear.c`.

The default SmolLM2 ships as a GGUF file of Q4_1 blocks (its token embedding, tied to the LM head, as
Q8_0); transformers decodes them to fp32 at load time, so every weight is exactly d * q + m (Q4_1) or
d * q (Q8_0) for one fp16 d (and m) per 32 weights of a row. A weight matrix for which that holds is found
again here from the fp32 values alone, without the GGUF file and whatever row order transformers gave
the layer, and checked weight by weight: a matrix with a single value off is not packed. So a model
whose weights were never blocks (every HF checkpoint in bf16 or fp32, every test's random model) keeps
its dense linears, and a packed one computes with exactly the weights it loaded.
"""
from __future__ import annotations

import torch

Q4_1, Q8_0 = 0, 1
BLOCK = 32  # weights per block, along a row (the input dimension)
TILE = 16   # outputs per packed tile (one AVX-512 register of fp32)
PAIR = 2 * TILE  # the kernel computes two tiles at a time


def _half_neighbours(d: torch.Tensor) -> list[torch.Tensor]:
    """d (fp16, >= 0) and the fp16 values one step above and below it."""
    bits = d.view(torch.int16)
    return [d, (bits + 1).view(torch.float16), (bits - 1).clamp(min=0).view(torch.float16)]


def _solve(blocks: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, qmin: int,
           qmax: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The integers q and fp16 scales d with blocks == d * q (+ offset) exactly, trying the scale
    estimate and its two fp16 neighbours per block; None if some block has no exact solution."""
    base = 0.0 if offset is None else offset.float().unsqueeze(-1)
    q_out = d_out = solved = None
    for d in _half_neighbours(scale):
        df = d.float().unsqueeze(-1)
        q = (blocks - base).div_(torch.where(df > 0, df, 1.0)).round_().clamp_(qmin, qmax).mul_(df > 0)
        exact = (q * df + base == blocks).all(-1)
        if solved is None:
            q_out, d_out, solved = q, d, exact
        else:
            q_out = torch.where((exact & ~solved).unsqueeze(-1), q, q_out)
            d_out = torch.where(exact & ~solved, d, d_out)
            solved = solved | exact
        if bool(solved.all()):
            return q_out, d_out
    return None


def _records(*parts: torch.Tensor) -> torch.Tensor:
    """Per (tile, block) byte records [tiles, blocks, bytes] from per-weight-row parts."""
    return torch.cat([p.contiguous().view(torch.uint8).reshape(p.shape[0], p.shape[1], -1) for p in parts], -1)


def _per_tile(values: torch.Tensor) -> torch.Tensor:
    """[n, blocks] per-row block scales to [tiles, blocks, TILE] (the lanes of a tile last)."""
    n, nblocks = values.shape
    return values.reshape(n // TILE, TILE, nblocks).permute(0, 2, 1)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The weight [out, in] as packed Q4_1 or Q8_0 records and its kind, or None if it is not exactly
    one of those (or not fp32, or its shape does not tile: out % 32, in % 32)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n % PAIR or k % BLOCK or n == 0:
        return None
    weight = weight.detach().contiguous()
    # A cheap look at the first rows first: most weights are not blocks, and they fail there.
    probe = min(n, PAIR)
    for kind in (Q4_1, Q8_0):
        if _solve_kind(weight[:probe], kind) is not None:
            solved = _solve_kind(weight, kind)
            if solved is not None:
                return _pack_kind(solved, n, k, kind), kind
    return None


def _solve_kind(weight: torch.Tensor, kind: int):
    n, k = weight.shape
    blocks = weight.reshape(n, k // BLOCK, BLOCK)
    if kind == Q4_1:
        low = blocks.amin(-1)
        offset = low.half()
        if not torch.equal(offset.float(), low):
            return None
        solved = _solve(blocks, ((blocks.amax(-1) - low) / 15).half(), offset, 0, 15)
        return None if solved is None else (*solved, offset)
    solved = _solve(blocks, (blocks.abs().amax(-1) / 127).half(), None, -128, 127)
    return None if solved is None else (*solved, None)


def _pack_kind(solved, n: int, k: int, kind: int) -> torch.Tensor:
    q, d, offset = solved
    tiles, nblocks = n // TILE, k // BLOCK
    if kind == Q4_1:
        # q[j][lane] = input 2j (low nibble) | input 2j + 1 (high nibble) of the lane's output.
        q = q.to(torch.uint8).reshape(tiles, TILE, nblocks, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
        nibbles = q[..., 0] | (q[..., 1] << 4)
        return _records(_per_tile(d), _per_tile(offset), nibbles.reshape(tiles, nblocks, -1))
    q = q.to(torch.int8).reshape(tiles, TILE, nblocks, BLOCK).permute(0, 2, 3, 1)
    return _records(_per_tile(d), q.reshape(tiles, nblocks, -1))


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
