"""C kernels for the CPU path, compiled on first use and loaded with ctypes.

PyTorch has no paged attention for CPUs: without a kernel, decode attention gathers every
sequence's blocks into a padded copy and runs SDPA, which is built for long query blocks and
spends most of its time on overhead when each sequence has one query token. The kernel in
`csrc/paged_attention.c` reads K/V in place from the blocks (bench/HISTORY.md, "Offline engine").
`csrc/prefill_attention.c` attends a prompt chunk over its paged context (flash-attention's loop in
registers, GQA rows together), where torch's fused CPU attention runs far below the CPU's speed.
`csrc/fused_ops.c` holds a decoder layer's elementwise ops (RMSNorm with the residual add, SiLU-and-mul,
rotary embedding), one call each instead of several torch ops (engine/cpu_layers.py).

Each shared library is built with the system C compiler into the tandem cache directory, keyed by
the source, the flags and the machine, so a build is done once per machine. Without a compiler,
or with TANDEM_CPU_KERNELS=0, `available()` is False: attention uses gather + SDPA and the layers
run as HF wrote them.
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

CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno"]
# fused_ops.c rounds like torch's separate ops: no contraction of a * b + c into one FMA; without FP traps
# its clamps and selects vectorize.
EXTRA_FLAGS = {"fused_ops": ["-ffp-contract=off", "-fno-trapping-math"], "block_linear": ["-fno-trapping-math"]}
# Kernels that use bf16 dot products (vdpbf16ps) where the CPU has them.
BF16_DOT = {"prefill_attention"}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _arch_flags(bf16_dot: bool = False) -> list[str]:
    """AVX-512 (F, BW, VL, DQ: x86-64-v4) or AVX2/FMA (x86-64-v3) where the CPU has them; otherwise the
    compiler's portable default. AVX-512 doubles the lanes and narrows fp32 to bf16 in one instruction.
    With `bf16_dot`, also AVX512-BF16 where the CPU has it (bf16 pair dot products)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return []
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    if not avx512 <= flags:
        return ["-mavx2", "-mfma"]
    bf16 = ["-mavx512bf16"] if bf16_dot and "avx512_bf16" in flags else []
    return ["-mavx2", "-mfma"] + [f"-m{flag}" for flag in sorted(avx512)] + bf16


def _build(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so that processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# Kernels wanted here that could not be built or loaded, so that torch computes their work instead: a fallback,
# exported per worker as tandem:cpu_kernel_fallbacks (engine stats) and expected to stay empty.
FAILED: set[str] = set()


def failed_kernels() -> list[str]:
    """The C kernels this process tried to load and runs without (not those turned off by TANDEM_CPU_KERNELS=0)."""
    return sorted(FAILED)


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the CPU path runs without its C kernels (%s)", name)
        FAILED.add(name)
        return None
    source = CSRC / f"{name}.c"
    flags = BASE_FLAGS + EXTRA_FLAGS.get(name, []) + _arch_flags(bf16_dot=name in BF16_DOT)
    headers = b"".join(header.read_bytes() for header in sorted(CSRC.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode() + platform.machine().encode())
    target = cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, flags, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the CPU kernels of %s failed, running without them: %s", name, detail)
        FAILED.add(name)
        return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = _load("paged_attention")
    if lib is not None:
        fn = lib.paged_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_int] * 3 + [ctypes.c_float]
    return lib


@functools.cache
def _prefill() -> ctypes.CDLL | None:
    lib = _load("prefill_attention")
    if lib is not None:
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.paged_prefill_attention.restype = i32
        lib.paged_prefill_attention.argtypes = ([ptr] * 5 + [i64] * 2 + [i32] * 6 + [ctypes.c_float] + [i32] * 4
                                                + [ctypes.c_float])
        lib.prefill_attention_supported.restype = i32
        lib.prefill_attention_supported.argtypes = [i32]
    return lib


def prefill_available(head_dim: int) -> bool:
    """Whether `paged_prefill_attention` runs here for this head size."""
    lib = _prefill()
    return lib is not None and bool(lib.prefill_attention_supported(head_dim))


def paged_prefill_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            window: int | None = None, softcap: float | None = None) -> None:
    """Causal attention of a prompt chunk: out[i] = softmax(q[i] K^T * scale) V over the first
    context_len - n_q + i + 1 tokens of the sequence whose blocks `block_table` names (its own K/V
    already written there); with a sliding `window`, over the last `window` of those only; with `softcap`,
    the scores pass through softcap * tanh(score / softcap) first.

    q: [n_q, num_heads, head_dim], any token and head strides, unit stride within a head; out: contiguous,
    same shape and dtype as q; caches: contiguous [num_blocks, block_size, num_kv_heads, head_dim]; q and the
    caches fp32 or bf16 (computed in fp32); block_table: contiguous int64 covering context_len tokens.
    """
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype or out.dtype != q.dtype:
        raise TypeError(f"paged_prefill_attention takes fp32 or bf16, got q {q.dtype}, cache {k_cache.dtype}")
    if q.stride(-1) != 1 or not out.is_contiguous() or block_table.dtype != torch.long:
        raise ValueError("paged_prefill_attention needs unit-stride heads, a contiguous out, an int64 table")
    n_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if -(-context_len // block_size) > block_table.numel():
        raise ValueError(f"a block table of {block_table.numel()} blocks cannot hold {context_len} tokens")
    status = _prefill().paged_prefill_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
        q.stride(0), q.stride(1), n_q, context_len, num_heads, num_kv_heads, head_dim, block_size, scale,
        torch.get_num_threads(), int(q.dtype == torch.bfloat16), int(k_cache.dtype == torch.bfloat16), window or 0,
        softcap or 0.0)
    if status == -2:
        raise ValueError(f"paged_prefill_attention cannot take {n_q} queries of {num_heads}/{num_kv_heads} heads "
                         f"of size {head_dim} over {context_len} tokens")
    if status != 0:
        raise MemoryError("paged_prefill_attention could not allocate its scratch memory")


@functools.cache
def _fused() -> ctypes.CDLL | None:
    lib = _load("fused_ops")
    if lib is not None:
        ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        for name, argtypes in (("rms_norm", [ptr] * 4 + [i32, i32, f32, i32, i32]),
                               ("silu_and_mul", [ptr, ptr, i32, i32, i32, i32]),
                               ("rope", [ptr] * 3 + [i32, i32, i32, i64, i32, i32])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def available() -> bool:
    return _library() is not None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def onednn_packs_bf16() -> bool:
    """Whether oneDNN can pack and run bf16 linears on this CPU (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT);
    where it cannot, a bf16 model keeps torch's own linears and HF's layers."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def prefill_kernel_wins(dtype: torch.dtype) -> bool:
    """Whether `paged_prefill_attention` beats torch's fused SDPA (on gathered blocks) for prompt chunks of
    `dtype` on this CPU (bench/prefill_attention.py): in fp32 it does (0.6-0.9x SDPA's time). In bf16 it does
    on CPUs without AMX (0.4-0.5x), but not on those with AMX-BF16, whose tiles run SDPA's bf16 GEMMs in
    oneDNN 2.3-2.5x faster than the kernel's AVX512-BF16 dot products. TANDEM_PREFILL_KERNEL=1 or 0 decides."""
    forced = os.environ.get("TANDEM_PREFILL_KERNEL")
    if forced in ("0", "1"):
        return forced == "1"
    return dtype != torch.bfloat16 or "amx_bf16" not in cpu_flags()


def fused_available() -> bool:
    return _fused() is not None


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> None:
    """out = weight * x / rms(x) per row, as HF's LlamaRMSNorm; with `residual`, x is first added to it
    and the sum stored back into `residual` (the layer's residual stream). All contiguous, one dtype."""
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    _fused().rms_norm(out.data_ptr(), x.data_ptr(), None if residual is None else residual.data_ptr(),
                      weight.data_ptr(), rows, dim, eps, DTYPES[x.dtype], torch.get_num_threads())


def silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """out = silu(gate) * up, gate_up = [gate | up] per row (contiguous)."""
    d = out.shape[-1]
    _fused().silu_and_mul(out.data_ptr(), gate_up.data_ptr(), out.numel() // d, d, DTYPES[out.dtype],
                          torch.get_num_threads())


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotary embedding in place on the first `heads` heads of each row of x [tokens, width] (rows may be
    strided, heads contiguous); cos, sin: [tokens, head_dim] contiguous."""
    if x.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("rope needs unit-stride rows and contiguous cos/sin")
    status = _fused().rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], heads, head_dim,
                           x.stride(0), DTYPES[x.dtype], torch.get_num_threads())
    if status != 0:
        raise ValueError(f"rope needs an even head_dim, got {head_dim}")


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, max_len: int,
                           scale: float, window: int | None = None, softcap: float | None = None) -> None:
    """out[s] = softmax(q[s] K_s^T * scale) V_s for each sequence s, one query token each; with a sliding
    `window`, over the last `window` positions of each context only; with `softcap`, the scores pass through
    softcap * tanh(score / softcap) before the softmax.

    q and out: contiguous fp32 [num_seqs, num_heads, head_dim]; caches: contiguous fp32 or bf16
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: contiguous int64
    [num_seqs, width] (padding is never read); context_lens: int64 [num_seqs], each in [1, max_len].
    """
    if k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype or q.dtype != torch.float32:
        raise TypeError(f"paged_decode_attention takes fp32 or bf16 caches and fp32 q, got {k_cache.dtype}, {q.dtype}")
    lib = _library()
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    status = lib.paged_decode_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        max_len, scale, torch.get_num_threads(), int(k_cache.dtype == torch.bfloat16), window or 0, softcap or 0.0)
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch memory or threads")


@functools.cache
def _blocks() -> ctypes.CDLL | None:
    lib = _load("block_linear")
    if lib is None or not lib.block_linear_supported():
        return None
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.block_linear.restype = i32
    lib.block_linear.argtypes = [ptr] * 3 + [i32] * 3 + [i64] * 2 + [i32] * 2
    lib.pack_blocks.restype = i32
    lib.pack_blocks.argtypes = [ptr, ptr, i32, i32, i32]
    return lib


def blocks_available() -> bool:
    """Whether `block_linear` runs here (an AVX-512 CPU and a C compiler)."""
    return _blocks() is not None


def pack_blocks(out: torch.Tensor, weight: torch.Tensor, kind: int) -> bool:
    """Writes weight [n, k] (contiguous fp32) into `out` as kind's records; False if it is not exactly
    blocks of that kind (engine/weight_blocks.py)."""
    return _blocks().pack_blocks(out.data_ptr(), weight.data_ptr(), weight.shape[0], weight.shape[1], kind) == 0


def block_linear(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, kind: int) -> None:
    """out = x W^T with W packed by engine/weight_blocks.py (kind 0 = Q4_1, 1 = Q8_0); x and out fp32
    [rows, in] and [rows, out_features], unit stride in the last dimension."""
    rows, n = out.shape
    status = _blocks().block_linear(out.data_ptr(), x.data_ptr(), packed.data_ptr(), rows, n, x.shape[1],
                                    x.stride(0), out.stride(0), kind, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"block_linear cannot compute {tuple(x.shape)} x {n} (kind {kind})")
