"""worker_runtime/heap.py: freed memory below a live allocation stays in the process until trimmed."""
import ctypes
import platform

import psutil
import pytest

from worker_runtime.heap import trim_heap

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc_trim")


def test_trim_gives_back_freed_pages_that_a_live_allocation_above_them_pins():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    rss = psutil.Process().memory_info
    size, count = 32 << 10, 2048  # 64 MiB of heap chunks (below the mmap threshold), touched
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    pin = libc.malloc(size)  # above them all: free() cannot shrink the heap from its top
    before = rss().rss
    for block in blocks:
        libc.free(block)
    freed = rss().rss
    assert before - freed < (16 << 20)  # freed, but still resident
    assert trim_heap()
    assert freed - rss().rss > (48 << 20)  # given back
    libc.free(pin)
