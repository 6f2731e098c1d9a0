"""Paged attention over the packed batch, registered with transformers' AttentionInterface.

The HF model sees one [1, T] sequence holding every scheduled token. Our attention
writes the new K/V into the paged cache through `slot_mapping`, then attends
decode tokens (query length 1) in one batched call and each prefill chunk on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.kv_cache import KVCache

ATTN_IMPLEMENTATION = "tandem_paged"


@dataclass(slots=True)
class PrefillSegment:
    start: int
    end: int
    context_len: int
    block_table: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSegment]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    tandem_attn: AttentionMetadata | None = None, **kwargs):
    md = tandem_attn
    layer = module.layer_idx
    k_cache, v_cache = md.kv_cache.k[layer], md.kv_cache.v[layer]
    _, num_kv_heads, num_tokens, head_dim = key.shape
    num_heads = query.shape[1]
    k_new = key[0].transpose(0, 1)
    v_new = value[0].transpose(0, 1)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k_new)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v_new)
    q = query[0].transpose(0, 1)
    out = torch.empty_like(q)
    if md.decode_token_idx is not None:
        out[md.decode_token_idx] = _decode(q[md.decode_token_idx], k_cache, v_cache, md, scaling)
    for seg in md.prefills:
        q_seg = q[seg.start:seg.end].transpose(0, 1)
        if seg.context_len == seg.end - seg.start:
            k_seg, v_seg = key[0, :, seg.start:seg.end], value[0, :, seg.start:seg.end]
            o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, is_causal=True, scale=scaling,
                                               enable_gqa=num_heads != num_kv_heads)
        else:
            k_seg = _gather(k_cache, seg.block_table, seg.context_len)
            v_seg = _gather(v_cache, seg.block_table, seg.context_len)
            q_len = seg.end - seg.start
            offset = seg.context_len - q_len
            mask = torch.ones(q_len, seg.context_len, dtype=torch.bool, device=q.device).tril(offset)
            o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, attn_mask=mask, scale=scaling,
                                               enable_gqa=num_heads != num_kv_heads)
        out[seg.start:seg.end] = o.transpose(0, 1)
    return out.unsqueeze(0), None


def _gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """[num_kv_heads, context_len, head_dim] for one sequence."""
    return cache[block_table].flatten(0, 1)[:context_len].transpose(0, 1)


def _decode(q, k_cache, v_cache, md: AttentionMetadata, scaling):
    """Decode tokens of many sequences in one call: q [B, H, D] against each one's padded context."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = k_cache[md.decode_block_tables].flatten(1, 2).permute(0, 2, 1, 3)
    v = v_cache[md.decode_block_tables].flatten(1, 2).permute(0, 2, 1, 3)
    q = q.view(batch, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=md.decode_mask, scale=scaling)
    return o.reshape(batch, num_heads, head_dim)


def _no_mask(*args, **kwargs):
    # Masking is positional and per sequence, so paged_attention builds it itself.
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
