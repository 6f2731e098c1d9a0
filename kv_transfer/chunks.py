"""Block-granular export and import between paged KV caches, one chunk at a time.

A chunk is layers [layer_start, layer_end) x a range of a pull's requested
blocks. Its payload, in wire order, is for each layer K then V of those
blocks, each [num_blocks, block_size, num_kv_heads, head_dim] in C order.
Both ends derive the same chunk plan from the pull request, so a receiver
knows every chunk's size before it arrives. Reads and writes are one tensor
op for the whole chunk on the cache's single `kv` tensor (a slice when the
block ids are consecutive, else `index_select` / `index_copy_` along the
block dimension); nothing is done per element or per layer in Python.

A chunk of few blocks over many layers is many small K/V segments. Below
`COALESCE_BELOW_BYTES` per segment it moves as one buffer (one message,
one checksum call) instead of a view per segment: the copy into that
buffer costs less than the calls and messages it saves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from engine.kv_cache import KVCache, KVLayout


# Per K (or V) segment. Measured on 2 cores (bench/HISTORY.md, "small pulls"): a pull of one block over 30
# layers (60 segments of 12 KiB) took 4.4 ms over Gloo as views and 1.4 ms coalesced; at 16 blocks
# (196 KiB segments) the gather copy cost about what the saved messages did (7.2 vs 6.7 ms).
COALESCE_BELOW_BYTES = 64 << 10
# A pull's smallest allowed chunk limit: smaller ones would turn a pull into very many messages.
MIN_CHUNK_BYTES = 4 << 10


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """Layers [layer_start, layer_end) x positions [block_start, block_end) of the pull's block list."""
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_blocks(self) -> int:
        return self.block_end - self.block_start

    def num_bytes(self, layout: KVLayout) -> int:
        return 2 * self.num_layers * self.num_blocks * layout.bytes_per_block_per_layer


def plan_chunks(layout: KVLayout, num_blocks: int, layer_start: int, layer_end: int,
                max_chunk_bytes: int) -> list[ChunkSpec]:
    """Split a pull into chunks of at most `max_chunk_bytes` (or one block-layer), early layers first."""
    block_layer = 2 * layout.bytes_per_block_per_layer
    if num_blocks == 0 or layer_end <= layer_start:
        return []
    if num_blocks * block_layer <= max_chunk_bytes:
        step = max(1, max_chunk_bytes // (num_blocks * block_layer))
        return [ChunkSpec(lo, min(lo + step, layer_end), 0, num_blocks)
                for lo in range(layer_start, layer_end, step)]
    pieces = -(-num_blocks * block_layer // max_chunk_bytes)
    bounds = [num_blocks * i // pieces for i in range(pieces + 1)]
    return [ChunkSpec(layer, layer + 1, lo, hi)
            for layer in range(layer_start, layer_end) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def coalesced(layout: KVLayout, spec: ChunkSpec) -> bool:
    """Whether the chunk moves as one buffer rather than as a segment per layer and K/V (same on both ends)."""
    return spec.num_blocks * layout.bytes_per_block_per_layer < COALESCE_BELOW_BYTES


def consecutive_start(block_ids: list[int]) -> int | None:
    """The first id when `block_ids` are consecutive ascending (the chunk is a slice), else None."""
    if block_ids and block_ids[-1] - block_ids[0] == len(block_ids) - 1 \
            and all(b - a == 1 for a, b in zip(block_ids, block_ids[1:])):
        return block_ids[0]
    return None


def _layers(cache: KVCache, spec: ChunkSpec) -> torch.Tensor:
    """The cache's [layers, 2, num_blocks, ...] for the chunk's layers."""
    return cache.kv[spec.layer_start:spec.layer_end]


def cache_views(cache: KVCache, block_ids: list[int], spec: ChunkSpec) -> list[torch.Tensor] | None:
    """The chunk's payload as views of the cache (K, V per layer) when its blocks are a slice."""
    start = consecutive_start(block_ids)
    if start is None or cache.tp_size > 1:
        return None  # a tensor-parallel cache's heads are spread over its ranks' slots: not one view
    return segments(_layers(cache, spec)[:, :, start:start + len(block_ids)])


def chunk_shape(layout: KVLayout, spec: ChunkSpec) -> tuple[int, ...]:
    """The payload as one tensor: [layers, 2 (K, V), blocks, block_size, heads, head_dim]."""
    return (spec.num_layers, 2, spec.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)


def _cache_shape(cache: KVCache, spec: ChunkSpec) -> tuple[int, ...]:
    """The payload shaped as the cache's `kv` (a tensor-parallel cache splits the heads by rank)."""
    return (spec.num_layers, 2, spec.num_blocks, *cache.kv.shape[3:])


def staging_buffer(cache: KVCache, spec: ChunkSpec) -> torch.Tensor:
    """An empty tensor of the chunk's payload shape on the cache's device."""
    return torch.empty(chunk_shape(cache.layout, spec), dtype=cache.kv.dtype, device=cache.kv.device)


def segments(payload: torch.Tensor) -> list[torch.Tensor]:
    """A [layers, 2, blocks, ...] payload (staging, or a block slice of the cache) as K, V views per layer."""
    return list(payload.flatten(0, 1).unbind(0))


def read_chunk(cache: KVCache, block_ids: list[int], spec: ChunkSpec) -> list[torch.Tensor]:
    """The chunk's payload: cache views (K, V per layer) if its blocks are a slice and it is not coalesced,
    else a gathered copy, as one buffer if coalesced or split like the views otherwise."""
    one_buffer = coalesced(cache.layout, spec)
    start = consecutive_start(block_ids)
    layers = _layers(cache, spec)
    if start is not None:
        block_slice = layers[:, :, start:start + len(block_ids)]
        if one_buffer or cache.tp_size > 1:  # a tensor-parallel cache: gathered in the wire's order
            block_slice = block_slice.contiguous()
        return [block_slice] if one_buffer else segments(block_slice)
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.kv.device)
    staging = torch.index_select(_wide(layers), 2, index).view(cache.kv.dtype)
    return [staging] if one_buffer else segments(staging)


def write_chunk(cache: KVCache, block_ids: list[int], spec: ChunkSpec, payload: torch.Tensor) -> None:
    """Scatter a payload (any tensor holding the chunk's bytes in wire order) into `block_ids`."""
    device = cache.kv.device
    src = payload.view(cache.kv.dtype).view(_cache_shape(cache, spec)).to(device)
    start = consecutive_start(block_ids)
    index = None if start is not None else torch.tensor(block_ids, dtype=torch.long, device=device)
    for replica in cache.replicas:  # one, unless a tensor-parallel cache holds each head several times
        layers = replica[spec.layer_start:spec.layer_end]
        if index is None:
            layers[:, :, start:start + len(block_ids)].copy_(src)
        else:
            _wide(layers).index_copy_(2, index, _wide(src))


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as 16-byte elements where the rows allow it: `index_copy_` moves those about 3x faster
    (measured on CPU: 32 vs 12 GB/s), and a bit copy does not care what the elements mean."""
    if (t.shape[-1] * t.element_size()) % 16 or t.stride(-1) != 1:
        return t
    return t.view(torch.complex128)


def host_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes without a copy (works for bfloat16, which numpy lacks)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def payload_checksum(tensors: list[torch.Tensor]) -> int:
    """XXH3-64 over CPU tensors' bytes, in order, as if they were one buffer (about 2x CRC32C's speed)."""
    digest = xxhash.xxh3_64()
    for t in tensors:
        digest.update(host_bytes(t))
    return digest.intdigest()
