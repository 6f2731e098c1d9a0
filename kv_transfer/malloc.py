"""Allocator tuning for processes that move KV in multi-megabyte pieces.

gRPC hands every received message to Python as a fresh `bytes` object, the
sender builds one per chunk, and scattered blocks go through per-chunk
staging tensors. glibc serves blocks this large with mmap and unmaps them on
free, so every chunk pays a page fault per 4 KiB on first touch: measured
here, that alone costs about a third of a transfer's CPU time. Raising the
mmap and trim thresholds keeps those buffers in the heap, where freed chunks
are reused warm.
"""
from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)


def keep_message_buffers_in_heap(max_message_bytes: int) -> bool:
    """Serve allocations up to `max_message_bytes` (at most 32 MiB) from the heap; False off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    threshold = min(max_message_bytes + (1 << 20), _MMAP_THRESHOLD_MAX)
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, 8 * threshold))
