"""Paged attention over the packed batch, registered with transformers' AttentionInterface.

The HF model sees one [1, T] sequence holding every scheduled token, decode tokens first. Our
attention writes the new K/V into the paged cache through `slot_mapping`, then attends the decode
tokens in a few batched calls (sequences of similar length grouped together) and each prefill
chunk on its own. Everything that depends only on the batch (index tensors, masks, the gather
workspace) is built once per step by the model runner, not once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine import cpu_kernels
from engine.kv_cache import KVCache

ATTN_IMPLEMENTATION = "tandem_paged"


@dataclass(slots=True)
class DecodeGroup:
    """Packed tokens [start, end) are decodes of sequences whose block tables, padded to one width,
    are `block_ids` (flattened). `mask` hides the padding; None when every context is `context_len` long.
    `lens`: each sequence's context length (made a tensor only by sliding-window layers)."""
    start: int
    end: int
    block_ids: torch.Tensor
    context_len: int
    mask: torch.Tensor | None
    lens: list[int] | None = None


@dataclass(slots=True)
class PagedDecodes:
    """Packed tokens [0, num_seqs) are decodes attended by the CPU kernel straight from the blocks:
    row s of `block_tables` (padded with unread zeros) holds `context_lens[s]` tokens."""
    num_seqs: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_len: int


@dataclass(slots=True)
class PrefillSegment:
    """Packed tokens [start, end) are one sequence's prompt chunk. With a cached or earlier-computed
    prefix, it attends the `block_ids` blocks under `mask`; without one (block_ids None) it is plain causal.
    `paged`: the CPU kernel attends it straight from its blocks (`block_ids`, its whole table; no mask)."""
    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    paged: bool = False


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor
    decodes: list[DecodeGroup]
    prefills: list[PrefillSegment]
    workspace: tuple[torch.Tensor, torch.Tensor] | None  # K and V gather buffers, reused by every layer
    paged_decodes: PagedDecodes | None = None  # set instead of `decodes` when the CPU kernel is used


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    tandem_attn: AttentionMetadata | None = None, **kwargs):
    md = tandem_attn
    # HF's attention passes its layer's window (None on full-attention layers); the fused layer holds it.
    # Gemma 2 passes `softcap`: its scores go through softcap * tanh(score / softcap) before the softmax.
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    softcap = kwargs.get("softcap")
    layer = module.layer_idx
    k_cache, v_cache = md.kv_cache.k[layer], md.kv_cache.v[layer]
    _, num_kv_heads, _, head_dim = key.shape
    num_heads = query.shape[1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, key[0].transpose(0, 1))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, value[0].transpose(0, 1))
    q = query[0].transpose(0, 1)
    scaling = head_dim ** -0.5 if scaling is None else scaling
    if md.paged_decodes is not None and not md.prefills:
        return _paged_decode(q, k_cache, v_cache, md.paged_decodes, scaling, window, softcap).unsqueeze(0), None
    if len(md.decodes) == 1 and not md.prefills:
        return _decode(q, k_cache, v_cache, md.decodes[0], md.workspace, scaling, window, softcap).unsqueeze(0), None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if md.paged_decodes is not None:
        num_seqs = md.paged_decodes.num_seqs
        out[:num_seqs] = _paged_decode(q[:num_seqs], k_cache, v_cache, md.paged_decodes, scaling, window, softcap)
    for group in md.decodes:
        out[group.start:group.end] = _decode(q[group.start:group.end], k_cache, v_cache, group, md.workspace, scaling,
                                             window, softcap)
    for seg in md.prefills:
        if seg.paged:
            cpu_kernels.paged_prefill_attention(out[seg.start:seg.end], q[seg.start:seg.end], k_cache, v_cache,
                                                seg.block_ids, seg.context_len, scaling, window, softcap)
            continue
        q_seg = q[seg.start:seg.end].transpose(0, 1).unsqueeze(0)
        if seg.block_ids is None:
            k_seg, v_seg = key[:, :, seg.start:seg.end], value[:, :, seg.start:seg.end]
        else:
            k_seg = _gather(k_cache, seg.block_ids, seg.context_len, md.workspace[0]).transpose(0, 1).unsqueeze(0)
            v_seg = _gather(v_cache, seg.block_ids, seg.context_len, md.workspace[1]).transpose(0, 1).unsqueeze(0)
        mask, causal = seg.mask, seg.block_ids is None
        if window is not None and window < seg.context_len:
            mask, causal = _window_mask(seg.end - seg.start, seg.context_len, window, q.device), False
        if softcap is not None:
            if causal:
                mask = _window_mask(seg.end - seg.start, seg.context_len, seg.context_len, q.device)
            k_seg = k_seg.repeat_interleave(num_heads // num_kv_heads, dim=1)
            v_seg = v_seg.repeat_interleave(num_heads // num_kv_heads, dim=1)
            o = _softcapped_attention(q_seg, k_seg, v_seg, mask, scaling, softcap)
        else:  # 4-d inputs keep SDPA on its fused CPU kernel; 3-d ones with GQA fall back to the math path.
            o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, attn_mask=mask, is_causal=causal,
                                               scale=scaling, enable_gqa=num_heads != num_kv_heads)
        out[seg.start:seg.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _softcapped_attention(q, k, v, mask: torch.Tensor | None, scaling: float, softcap: float) -> torch.Tensor:
    """Attention whose scores go through softcap * tanh(score / softcap), which SDPA cannot do: in fp32, as
    HF's eager attention for Gemma 2 computes it; `mask` (True = attend) broadcasts over the scores."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _window_mask(num_new: int, context_len: int, window: int, device) -> torch.Tensor:
    """[num_new, context_len]: the chunk's token i, at position context_len - num_new + i, sees the keys in
    (position - window, position], as HF's sliding window does."""
    pos = torch.arange(context_len - num_new, context_len, device=device).unsqueeze(1)
    keys = torch.arange(context_len, device=device).unsqueeze(0)
    return (keys <= pos) & (keys > pos - window)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, context_len: int, buffer: torch.Tensor) -> torch.Tensor:
    """[context_len, num_kv_heads, head_dim] of one sequence, copied into the workspace."""
    blocks = torch.index_select(cache, 0, block_ids, out=buffer[:len(block_ids)])
    return blocks.flatten(0, 1)[:context_len]


def _paged_decode(q, k_cache, v_cache, decodes: PagedDecodes, scaling: float, window: int | None,
                  softcap: float | None) -> torch.Tensor:
    """The C kernel computes in fp32 (a bf16 cache is widened as it is read); q and out follow."""
    q32 = q.to(torch.float32).contiguous()
    out = torch.empty_like(q32)
    cpu_kernels.paged_decode_attention(out, q32, k_cache, v_cache, decodes.block_tables, decodes.context_lens,
                                       decodes.max_len, scaling, window, softcap)
    return out.to(q.dtype)


def _decode(q, k_cache, v_cache, group: DecodeGroup, workspace, scaling, window: int | None = None,
            softcap: float | None = None):
    """q [B, H, D], one token per sequence, against each sequence's context in one SDPA call.
    The query heads sharing a KV head become that head's query rows, so K/V are never repeated."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    width = len(group.block_ids) // batch
    shape = (batch, width * k_cache.shape[1], num_kv_heads, head_dim)
    k = torch.index_select(k_cache, 0, group.block_ids, out=workspace[0][:len(group.block_ids)]).view(shape)
    v = torch.index_select(v_cache, 0, group.block_ids, out=workspace[1][:len(group.block_ids)]).view(shape)
    k = k[:, :group.context_len].transpose(1, 2)
    v = v[:, :group.context_len].transpose(1, 2)
    q = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = group.mask
    if window is not None and window < group.context_len:  # each sequence sees its last `window` positions
        span = torch.arange(group.context_len, device=q.device).unsqueeze(0)
        lens = torch.tensor(group.lens, device=q.device).unsqueeze(1)
        mask = ((span < lens) & (span >= lens - window))[:, None, None, :]
    if softcap is not None:
        o = _softcapped_attention(q, k, v, mask, scaling, softcap)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return o.reshape(batch, num_heads, head_dim)


def _no_mask(*args, **kwargs):
    # Masking is positional and per sequence, so paged_attention builds it itself.
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
