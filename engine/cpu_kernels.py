"""C kernels for the CPU path, compiled on first use and loaded with ctypes.

PyTorch has no paged attention for CPUs: without a kernel, decode attention gathers every
sequence's blocks into a padded copy and runs SDPA, which is built for long query blocks and
spends most of its time on overhead when each sequence has one query token. The kernel in
`csrc/paged_attention.c` reads K/V in place from the blocks (bench/RESULTS.md, "Offline engine").

The shared library is built with the system C compiler into the tandem cache directory, keyed by
the source, the flags and the machine, so a build is done once per machine. Without a compiler,
or with TANDEM_CPU_KERNELS=0, `available()` is False and attention uses gather + SDPA.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.model_loader import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno"]


def _arch_flags() -> list[str]:
    """AVX2/FMA where the CPU has them (x86-64-v3); otherwise the compiler's portable default."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags else []


def _build(compiler: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so that processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention falls back to gather + SDPA")
        return None
    flags = BASE_FLAGS + _arch_flags()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + platform.machine().encode())
    target = cache_dir() / "kernels" / f"paged_attention-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, flags, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the CPU attention kernel failed, falling back to SDPA: %s", detail)
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int]
    return lib


def available() -> bool:
    return _library() is not None


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, max_len: int,
                           scale: float) -> None:
    """out[s] = softmax(q[s] K_s^T * scale) V_s for each sequence s, one query token each.

    q and out: contiguous fp32 [num_seqs, num_heads, head_dim]; caches: contiguous fp32
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: contiguous int64
    [num_seqs, width] (padding is never read); context_lens: int64 [num_seqs], each in [1, max_len].
    """
    lib = _library()
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    status = lib.paged_decode_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        max_len, scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch memory or threads")
