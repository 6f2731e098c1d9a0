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
    """The block pool of one engine; `k[layer]` and `v[layer]` are indexed by block id.

    A tensor-parallel engine's ranks (`tp` = (size, rank)) share one cache in a memfd, rank-major: rank r's
    KV heads are slot r, [num_layers, 2, size, num_blocks, block_size, heads per rank, head_dim], and its `k`,
    `v` are its slot's (contiguous per layer). `layout` is the whole model's, and `kv` a view of every head in
    the wire's order, [num_layers, 2, num_blocks, block_size, size, heads per rank, head_dim], so that KV
    transfer reads and writes whole blocks whatever the TP sizes of the two ends. With fewer KV heads than ranks,
    each head is replicated in size / heads slots: `kv` reads the first, and `replicas` lists one such view per
    copy, for writes. Rank 0 creates the memfd (`fd` None); the others map it through `/proc/<pid>/fd/<fd>`."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu", shared: bool = False,
                 tp: tuple[int, int] | None = None, source: tuple[int, int] | None = None):
        """`shared` (CPU only): the blocks live in a memfd that a decode worker on the same host maps to copy
        leased blocks out directly (kv_transfer/shm.py); `shm_fd` is its descriptor, else None. `tp` (CPU only):
        see above; `source`, (pid, fd) of rank 0's memfd, for the other ranks."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.shm_fd: int | None = None
        self.tp_size, self.rank = tp or (1, 0)
        shape = self.memory_shape(layout, num_blocks, self.tp_size)
        dtype = getattr(torch, layout.dtype)
        if source is not None:
            self._map = _map_file(f"/proc/{source[0]}/fd/{source[1]}", math.prod(shape) * dtype.itemsize)
            memory = torch.frombuffer(self._map, dtype=dtype).view(shape)
        elif (shared or tp) and torch.device(device).type == "cpu" and hasattr(os, "memfd_create"):
            size = math.prod(shape) * dtype.itemsize
            self.shm_fd = os.memfd_create(f"tandem-kv-{os.getpid()}")
            os.ftruncate(self.shm_fd, size)  # zero-filled, like torch.zeros
            # Mapped with every page in place now (as torch.zeros touches them): a page first touched later
            # costs a fault per 4 KiB, not per 2 MiB huge page, and in a VM that was 40-50 us each.
            self._map = mmap.mmap(self.shm_fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            memory = torch.frombuffer(self._map, dtype=dtype).view(shape)
        elif tp is not None and self.tp_size > 1:
            raise ValueError("a tensor-parallel KV cache is shared memory: CPU only")
        else:
            memory = torch.zeros(shape, dtype=dtype, device=device)
        self.memory = memory
        self.replicas = replicas(memory, layout, self.tp_size)
        self.kv = self.replicas[0]
        own = memory if self.tp_size == 1 else memory[:, :, self.rank]
        self.k = list(own[:, 0].unbind(0))
        self.v = list(own[:, 1].unbind(0))

    @staticmethod
    def memory_shape(layout: KVLayout, num_blocks: int, tp_size: int = 1) -> tuple[int, ...]:
        """The cache's memory: `shape`, or with tensor parallelism a slot per rank."""
        if tp_size == 1:
            return KVCache.shape(layout, num_blocks)
        heads = max(1, layout.num_kv_heads // tp_size)
        return (layout.num_layers, 2, tp_size, num_blocks, layout.block_size, heads, layout.head_dim)

    @staticmethod
    def shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
        return (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (src, dst) block's K and V in every layer (copy on write of a shared block): a rank of a
        tensor-parallel cache copies its own slot."""
        if copies:
            src, dst = (torch.tensor(ids, device=self.memory.device) for ids in zip(*copies))
            own = self.memory if self.tp_size == 1 else self.memory[:, :, self.rank]
            own[:, :, dst] = own[:, :, src]

    @staticmethod
    def num_blocks_for_budget(layout: KVLayout, memory_bytes: float, tp_size: int = 1) -> int:
        """Blocks that fit `memory_bytes` (with tensor parallelism: all ranks' slots together)."""
        per_block = math.prod(KVCache.memory_shape(layout, 1, tp_size)) * getattr(torch, layout.dtype).itemsize
        return max(2, int(memory_bytes // per_block))


def replicas(memory: torch.Tensor, layout: KVLayout, tp_size: int) -> list[torch.Tensor]:
    """Views of a cache's memory holding every KV head once, in the wire's order: the memory itself, or for a
    tensor-parallel cache [layers, 2, blocks, block_size, ranks, heads per rank, dim], one view per copy of
    each head (several when there are fewer KV heads than ranks)."""
    if tp_size == 1:
        return [memory]
    every = memory.permute(0, 1, 3, 4, 2, 5, 6)
    copies = tp_size * memory.shape[5] // layout.num_kv_heads
    return [every[:, :, :, :, j::copies] for j in range(copies)]


def every_head(memory: torch.Tensor, layout: KVLayout, tp_size: int) -> torch.Tensor:
    """The first of `replicas`: what is read."""
    return replicas(memory, layout, tp_size)[0]


def copy_heads(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy blocks between views of every head of two caches whose ranks split the heads differently (a view is
    [..., heads, dim], or [..., ranks, heads per rank, dim]): at once when they split them alike, else a head
    at a time."""
    if dst.shape == src.shape:
        dst.copy_(src)
        return
    for h in range(math.prod(src.shape[4:-1])):
        _head(dst, h).copy_(_head(src, h))


def _head(view: torch.Tensor, h: int) -> torch.Tensor:
    if view.dim() == 6:
        return view[:, :, :, :, h]
    return view[:, :, :, :, h // view.shape[5], h % view.shape[5]]


def _map_file(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} is not a KV cache of the expected size ({size} bytes)")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
