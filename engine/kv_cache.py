"""The paged KV cache: per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim].

All of it is one tensor `kv` of shape [num_layers, 2, num_blocks, ...]; `k[layer]` and `v[layer]` are
its (contiguous) slices, so attention sees a plain per-layer cache while KV transfer moves a block
range across many layers with one tensor op.
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two peers must agree on before KV blocks can move between them."""
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Bytes of K (or of V) for one block in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * getattr(torch, self.dtype).itemsize

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.bytes_per_block_per_layer // self.block_size


class KVCache:
    """The block pool of one engine; `k[layer]` and `v[layer]` are indexed by block id."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu", shared: bool = False):
        """`shared` (CPU only): the blocks live in a memfd that a decode worker on the same host maps to copy
        leased blocks out directly (kv_transfer/shm.py); `shm_fd` is its descriptor, else None."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.shm_fd: int | None = None
        shape = self.shape(layout, num_blocks)
        dtype = getattr(torch, layout.dtype)
        if shared and torch.device(device).type == "cpu" and hasattr(os, "memfd_create"):
            size = math.prod(shape) * dtype.itemsize
            self.shm_fd = os.memfd_create(f"tandem-kv-{os.getpid()}")
            os.ftruncate(self.shm_fd, size)  # zero-filled, like torch.zeros
            # Mapped with every page in place now (as torch.zeros touches them): a page first touched later
            # costs a fault per 4 KiB, not per 2 MiB huge page, and in a VM that was 40-50 us each.
            self._map = mmap.mmap(self.shm_fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            self.kv = torch.frombuffer(self._map, dtype=dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self.kv[:, 0].unbind(0))
        self.v = list(self.kv[:, 1].unbind(0))

    @staticmethod
    def shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
        return (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (src, dst) block's K and V in every layer (copy on write of a shared block)."""
        if copies:
            src, dst = (torch.tensor(ids, device=self.kv.device) for ids in zip(*copies))
            self.kv[:, :, dst] = self.kv[:, :, src]

    @staticmethod
    def num_blocks_for_budget(layout: KVLayout, memory_bytes: float) -> int:
        per_block = 2 * layout.num_layers * layout.bytes_per_block_per_layer
        return max(2, int(memory_bytes // per_block))
