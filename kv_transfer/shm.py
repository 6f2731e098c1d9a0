"""Same-host KV pulls through shared memory: the decode worker copies a leased request's blocks straight out
of the prefill worker's cache, instead of receiving them over gRPC.

A prefill worker on CPU keeps its KV cache in a memfd (`KVCache(..., shared=True)`) and puts a `ShmSource`
into each handle: its host key, its pid, the memfd's descriptor and the leased block ids. A decode worker
with the same host key (the same kernel boot, network and pid namespaces: one machine, one pod) opens
`/proc/<pid>/fd/<fd>`, maps it once, and copies the blocks it lacks straight into its cache, a run of
consecutive blocks per copy: no encoding, no checksums, no staging buffer. Anything else (another host,
another pod, a simulated host in its own network namespace, a GPU cache) pulls over gRPC as before.

The lease is what makes the copy safe: the prefill worker frees leased blocks only when the lease is
released or expires. So the decode worker copies first and releases the lease after, over the usual RPC:
if the prefill worker no longer held it (expired, or the worker restarted), the copy may hold reused blocks
and the pull fails like any other expired lease.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache, copy_heads, every_head


@functools.cache
def host_key() -> str:
    """What two processes share when each can map the other's memfd by its /proc path: one kernel boot,
    one network namespace (simulated hosts in tests have their own) and one pid namespace (one pod)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        net, pid = os.stat("/proc/self/ns/net").st_ino, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{net}:{pid}"


@dataclass(frozen=True, slots=True)
class ShmSource:
    """Where a leased request's blocks sit in the prefill worker's shared cache."""
    host: str
    pid: int
    fd: int
    inode: int  # of the memfd: a map made for a dead worker whose pid and fd came back is not reused
    num_blocks: int  # of the whole cache: the mapping's shape is checked against it
    block_ids: tuple[int, ...]  # the lease's blocks, in the request's order
    tp_size: int = 1  # a tensor-parallel worker's cache holds a slot per rank (engine/kv_cache.py)


def source(cache: KVCache, block_ids: list[int]) -> ShmSource | None:
    """The handle's ShmSource for a lease of `block_ids`, or None if the cache is not shared."""
    if cache.shm_fd is None:
        return None
    return ShmSource(host_key(), os.getpid(), cache.shm_fd, os.fstat(cache.shm_fd).st_ino, cache.num_blocks,
                     tuple(block_ids), cache.tp_size)


class SharedCaches:
    """A decode worker's maps of the prefill workers' caches it has pulled from, by (pid, fd, inode). A map
    keeps its worker's cache alive, so maps of workers that are gone are dropped when the next is made. Pulls
    run on several threads at once, so the maps change under a lock: unlocked, two first pulls from a new worker
    at once (one dropping the maps of workers gone while the other added its map) fail one of them with
    RuntimeError, "dictionary keys changed during iteration", an internal error for its request (the likely
    cause of a request that failed with RuntimeError in CI, in a prefill scale-up and down under load)."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.host = host_key()
        self._maps: dict[tuple[int, int, int], tuple[torch.Tensor, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def usable(self, src: ShmSource | None) -> bool:
        """Whether a handle's source can be read here: same host key, a CPU cache on both sides."""
        return src is not None and bool(self.host) and src.host == self.host and self.cache.kv.device.type == "cpu"

    def copy(self, src: ShmSource, indices: list[int], dst_block_ids: list[int]) -> int:
        """Copy blocks `indices` of the lease into our `dst_block_ids`; the bytes copied. OSError if the
        prefill worker's cache cannot be mapped (gone, or not ours to open)."""
        kv = self._map(src)
        # Straight from the map into the cache, a run of consecutive blocks per copy: a gathered temporary
        # would be fresh pages for every pull (12 MB of page faults for a 256-token SmolLM2 prompt).
        pairs = [(src.block_ids[i], d) for i, d in zip(indices, dst_block_ids)]
        start = 0
        for end in range(1, len(pairs) + 1):
            if end == len(pairs) or pairs[end] != (pairs[end - 1][0] + 1, pairs[end - 1][1] + 1):
                (s, d), n = pairs[start], end - start
                for replica in self.cache.replicas:
                    copy_heads(replica[:, :, d:d + n], kv[:, :, s:s + n])
                start = end
        return 2 * self.cache.layout.num_layers * len(indices) * self.cache.layout.bytes_per_block_per_layer

    def forget(self, src: ShmSource) -> None:
        """Drop a map (its worker is gone, or it failed): the next pull from that pid opens it again."""
        with self._lock:
            self._maps.pop((src.pid, src.fd, src.inode), None)

    def _map(self, src: ShmSource) -> torch.Tensor:
        with self._lock:
            return self._map_locked(src)

    def _map_locked(self, src: ShmSource) -> torch.Tensor:
        key = (src.pid, src.fd, src.inode)
        if key not in self._maps:
            for old in [k for k in self._maps if not os.path.exists(f"/proc/{k[0]}/fd/{k[1]}")]:
                del self._maps[old]
            shape = KVCache.memory_shape(self.cache.layout, src.num_blocks, src.tp_size)
            path = f"/proc/{src.pid}/fd/{src.fd}"
            fd = os.open(path, os.O_RDONLY)
            try:
                info = os.fstat(fd)
                if info.st_ino != src.inode:
                    raise OSError(f"{path} is not the cache the handle names (its worker is gone)")
                size = math.prod(shape) * self.cache.kv.element_size()
                if info.st_size != size:
                    raise OSError(f"{path} does not hold a KV cache of {src.num_blocks} blocks of our layout")
                # read-only, every page table entry made now: one pass instead of a fault per page later
                view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            with warnings.catch_warnings():  # a read-only buffer: we only ever copy out of it
                warnings.simplefilter("ignore")
                kv = every_head(torch.frombuffer(view, dtype=self.cache.kv.dtype).view(shape), self.cache.layout,
                                src.tp_size)
            self._maps[key] = kv, view
        return self._maps[key][0]
