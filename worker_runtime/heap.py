"""Giving freed heap memory back to the operating system in long-lived serving processes.

glibc keeps memory that Python and native libraries (Ray's core worker, gRPC, protobuf) free inside its
arenas, and returns it only from the top of each heap. A process that serves requests for days frees memory
all over its heaps, so its RSS creeps up by the fragments that cannot be given back from the top (the
ingress: ~1.5 KiB a request over a 10,000-request soak, with its Python heap flat). `malloc_trim(0)` walks
every arena and gives back each free page wherever it is.
"""
from __future__ import annotations

import ctypes
import platform

_libc = None


def trim_heap() -> bool:
    """Give the free pages of every malloc arena back to the OS; False where that is not glibc (or nothing
    was given back)."""
    global _libc
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None)
    return bool(_libc.malloc_trim(0))
