"""Engine configuration: which model, where it runs, and the cache/scheduler budgets."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_tiers_config import KVTiersConfig
from engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:  # torch loads where a model runs, not in the control plane that only reads configs
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("auto", "float32", "float16", "bfloat16")


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    import torch
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# What `dtype: auto` means on CPU, when set: "float32" or "bfloat16" (the test suite pins float32, whose
# results it checks against fp32 references). Unset: bfloat16 where the CPU multiplies it natively.
CPU_AUTO_DTYPE_ENV = "TANDEM_CPU_AUTO_DTYPE"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX512-BF16): there oneDNN runs bf16
    linears several times faster than fp32 (a 256-token SmolLM2 prefill 2.5x, a 16-sequence decode step
    1.7x on the dev box's Sapphire Rapids cores); elsewhere bf16 is emulated and slower than fp32."""
    import torch
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(check is not None and check() for check in checks)


def resolve_dtype(dtype: str, device: str | torch.device) -> str:
    """The dtype a model runs in on `device`: `auto` is bfloat16 on CUDA; on CPU, bfloat16 where the CPU
    multiplies it natively and float32 elsewhere (or what TANDEM_CPU_AUTO_DTYPE says), as vLLM's CPU
    backend runs bf16 by default."""
    if dtype != "auto":
        return dtype
    device = resolve_device(device) if isinstance(device, str) else device
    if device.type == "cuda":
        return "bfloat16"
    pinned = os.environ.get(CPU_AUTO_DTYPE_ENV)
    if pinned:
        if pinned not in ("float32", "bfloat16"):
            raise ValueError(f"{CPU_AUTO_DTYPE_ENV} must be float32 or bfloat16, got {pinned!r}")
        return pinned
    return "bfloat16" if cpu_has_native_bf16() else "float32"


@dataclass(slots=True)
class CpuBinding:
    """What a worker asks for: `cores` physical cores of its own; `lend` them while its engine is idle
    (decode); `borrow` lent cores for its forwards (prefill). `lend_busy_ms` (a lender's): while a
    neighbour's prompt is being computed, a busy lender also lends its cores between its steps, so that
    one step starts at most every `lend_busy_ms` (0: it lends only while idle)."""
    cores: int
    lend: bool = False
    borrow: bool = False
    lend_busy_ms: float = 0.0
    top: bool = False  # take the highest free cores (decode), leaving the lowest to prefill


@dataclass(slots=True)
class EngineConfig:
    """`model` is None or "smollm2-135m-instruct" for the default model, or a local HF directory."""
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    # CPU: the KV cache in a memfd that a decode worker on this host can map (a prefill worker's; kv_transfer/shm.py)
    kv_cache_shared: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # CPU fp32: decode-sized linears read the weights' shipped Q4_1/Q8_0 blocks where the weights are exactly
    # those (engine/weight_blocks.py); the same weights, a fifth of the bytes per decode step.
    weight_blocks: bool = True
    num_threads: int | None = None
    cpu_binding: CpuBinding | None = None  # a worker's own cores on CPU (worker_runtime/cpu_cores.py); None: unpinned
    # A decode worker caps the prompt tokens of a step beside running decodes so that the step's predicted
    # time stays within this (stall-free batching); None: chunks up to max_num_batched_tokens.
    itl_slo_ms: float | None = None
    stall_ratio: float = 2.0  # ... and within this many plain decode steps
    # A forward on borrowed cores (a prefill worker's, worker_runtime/cpu_cores.py) carries at most the prompt tokens
    # predicted to take this long at the borrowed speed: a lender that turns busy shares its core with the
    # forward until it ends. None or 0: chunks up to max_num_batched_tokens.
    borrow_slice_ms: float | None = None
    # (start, end) of the model's thinking, e.g. ("<think>", "</think>"): what max_reasoning_tokens caps.
    reasoning_markers: tuple[str, str] | None = None
    # Speculative decoding for the requests that do not opt out (a decode pool's default); None: only
    # requests that opt in (SamplingParams.speculative) speculate, with the default SpeculativeConfig.
    speculative_config: SpeculativeConfig | None = None
    # Ranks that each hold 1/N of the model and its KV heads (engine/parallel/); num_threads is split among them.
    tensor_parallel_size: int = 1
    # Tiers below the KV cache that evicted prefix blocks go down to and come back from (engine/kv_tiers.py).
    kv_tiers: KVTiersConfig | None = None
    # LoRA adapters (engine/lora.py): requests may name one; `max_loras` device slots of rank up to
    # `max_lora_rank`, and host copies of up to `max_cpu_loras` (None: max_loras) adapters.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # A waiting request's priority improves by one per this many seconds since it was queued (ClusterConfig's
    # flow.aging_s), so that none waits forever behind a stream of more urgent ones; None: no aging.
    priority_aging_s: float | None = 10.0
    # A prompt less urgent than one queued within the last `yield_window_s` is computed in chunks of about this
    # long, so that a more urgent one that comes meanwhile waits at most about that (Scheduler, "Yielding";
    # ClusterConfig's flow.yield_slice_ms); None: prompts never yield.
    yield_slice_ms: float | None = None
    yield_window_s: float = 30.0
    # A step that carries a prompt chunk takes another prompt's only within this many prompt tokens (Scheduler);
    # None: by device, 256 on CPU (a bigger forward is no faster per token there), no limit on GPUs; 0: no limit.
    prefill_batch_tokens: int | None = None

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be positive")
        if self.yield_slice_ms is not None and not self.yield_slice_ms > 0:
            raise ValueError(f"yield_slice_ms must be positive or None, got {self.yield_slice_ms}")
        if not self.yield_window_s > 0:
            raise ValueError(f"yield_window_s must be positive, got {self.yield_window_s}")
        if self.prefill_batch_tokens is not None and self.prefill_batch_tokens < 0:
            raise ValueError(f"prefill_batch_tokens must be 0 (no limit), positive or None, got "
                             f"{self.prefill_batch_tokens}")
        if self.priority_aging_s is not None and not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be positive or None, got {self.priority_aging_s}")
        if self.reasoning_markers is not None and not all(self.reasoning_markers):
            raise ValueError("reasoning_markers must be two non-empty strings")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters with tensor_parallel_size > 1 are not supported yet")
        if self.kv_tiers is not None and self.kv_tiers.enabled and not self.enable_prefix_caching:
            raise ValueError("kv_tiers hold prefix-cache blocks: they need enable_prefix_caching")

    @property
    def resolved_dtype(self) -> str:
        """The concrete dtype name (never `auto`), as the KV layout and status report it."""
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch
        return getattr(torch, self.resolved_dtype)

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def model_id(self) -> str:
        return self.model or DEFAULT_MODEL

    def apply_threads(self) -> None:
        import torch
        threads = self.num_threads or int(os.environ.get("TANDEM_NUM_THREADS", 0)) or os.cpu_count() or 1
        torch.set_num_threads(max(1, threads // self.tensor_parallel_size))
