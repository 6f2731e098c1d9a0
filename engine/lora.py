"""LoRA adapters (PEFT format) served on the base model, several in one batch.

An engine with LoRA enabled wraps the linears of each decoder layer (q/k/v/o and the MLP's projections, or the
CPU path's fused qkv and gate-up projections, engine/cpu_layers.py) in a `LoRALinear`. Adapters live in
`max_loras` device slots, loaded from host memory into a slot when a request that names one is admitted and
kept there, least recently used first out, while no running request uses it (vLLM's `max_loras`, its LRU
adapter cache). Each wrapper holds every slot's A matrices stacked ([slots x R, in], R = rank room of its
slices) and B matrices scaled by alpha / r ([slots x R, out], block-diagonal over the slices of a fused
projection). A step computes, for all its rows at once, h = x @ A^T, zeroes the columns of slots other than
each row's own (a mask made once per step), and adds h @ B to the base output: three kernels per wrapper
whatever mix of adapters the batch holds, exact (the masked products are exact zeros), and shape-static.
Rows of the base model have no slot and get nothing added.

A request's adapter is part of its prefix-block hashes (`LoRARequest.key`, engine/hashing.py), so a prefix
computed with one adapter never serves another, nor the base model."""
from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.lora_request import LoRAError, LoRARequest, adapter_digest, adapter_files


# The projections PEFT adapters target, by their name in HF's decoder layer, and where each lands in a fused
# CPU layer (engine/cpu_layers.FusedDecoderLayer): (fused module, slice index).
FUSED_SLICES = {"self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1),
                "self_attn.v_proj": ("qkv_proj", 2), "self_attn.o_proj": ("o_proj", 0),
                "mlp.gate_proj": ("gate_up_proj", 0), "mlp.up_proj": ("gate_up_proj", 1),
                "mlp.down_proj": ("down_proj", 0)}
# Children of a layer's attention and MLP blocks that are wrapped when they are linears (HF names; Phi-3 fuses
# qkv_proj and gate_up_proj itself).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass(slots=True)
class LoRAWeights:
    """An adapter in host memory: per (layer, HF module name), A [r, in] and B [out, r] already scaled."""
    request: LoRARequest
    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def read_adapter(request: LoRARequest, max_rank: int) -> LoRAWeights:
    """Read and check a PEFT adapter: plain LoRA (no DoRA, no bias, no modules_to_save, no per-module ranks) on
    decoder-layer linears, rank at most `max_rank`, files unchanged since `request` was made."""
    config_file, weights_file = adapter_files(request.path)
    if adapter_digest(request.path) != request.digest:
        raise LoRAError(f"adapter {request.name}: the files at {request.path} changed since it was registered")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"adapter {request.name}: unreadable adapter_config.json ({e})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {request.name}: adapter_config.json is not an object")
    _check_config(request.name, config, max_rank)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scaling = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
    state = _load_state(weights_file)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRAError(f"adapter {request.name}: weight {key} is not a LoRA matrix of a decoder layer "
                            f"(embedding and head adapters are not supported)")
        layer, module, which = int(match[1]), match[2], match[3]
        pairs.setdefault((layer, module), {})[which] = tensor
    weights = LoRAWeights(request, rank)
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {request.name}: layer {layer} {module} lacks its lora_{'AB'[len(ab) == 1 and 'A' in ab]}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise LoRAError(f"adapter {request.name}: layer {layer} {module} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}, not a LoRA pair of rank at most max_lora_rank={max_rank}")
        weights.modules[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    if not weights.modules:
        raise LoRAError(f"adapter {request.name}: no LoRA weights in {weights_file.name}")
    return weights


def _check_config(name: str, config: dict, max_rank: int) -> None:
    rank = config.get("r")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name}: peft_type {config.get('peft_type')!r} is not LORA")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"adapter {name}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"adapter {name}: rank {rank} exceeds max_lora_rank={max_rank}")
    unsupported = [what for what, present in (
        ("DoRA (use_dora)", config.get("use_dora")), ("LoRA biases (bias)", config.get("bias", "none") != "none"),
        ("modules_to_save", config.get("modules_to_save")), ("per-module ranks (rank_pattern)", config.get("rank_pattern")),
        ("per-module alphas (alpha_pattern)", config.get("alpha_pattern")), ("fan_in_fan_out", config.get("fan_in_fan_out")),
        ("trainable token indices", config.get("trainable_token_indices"))) if present]
    if unsupported:
        raise LoRAError(f"adapter {name} uses {', '.join(unsupported)}, which tandem's LoRA does not implement")


def _load_state(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt or truncated file: any of several library errors
        raise LoRAError(f"cannot read {file}: {e}") from None


class LoRAContext:
    """The step's rows → slots, shared by every LoRALinear of a model: None when no row runs an adapter."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.row_slots: torch.Tensor | None = None  # [rows] slot per packed row, -1 for the base model
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._columns: dict[tuple[int, torch.device], torch.Tensor] = {}

    def set_rows(self, row_slots: torch.Tensor | None) -> None:
        self.row_slots = row_slots
        self._masks = {}

    def mask(self, room: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, slots x room]: 1 where the column belongs to the row's slot."""
        mask = self._masks.get((room, dtype))
        if mask is None:
            device = self.row_slots.device
            columns = self._columns.get((room, device))
            if columns is None:
                columns = self._columns[(room, device)] = torch.arange(self.max_loras * room, device=device) // room
            mask = self._masks[(room, dtype)] = (self.row_slots.unsqueeze(1) == columns).to(dtype)
        return mask


class LoRALinear(torch.nn.Module):
    """A linear (nn.Linear, or the CPU path's oneDNN or block linears) plus every slot's LoRA delta. `widths`:
    the output widths of the projections it computes side by side (one, or q/k/v, or gate/up).

    On the CPU path's oneDNN linears (which keep their weight unpacked for it) the adapters' A rows are packed
    beside the weight, so one GEMM computes the projection and every slot's x @ A^T: oneDNN's bf16 calls cost
    ~30 us each at decode sizes whatever their size, and a separate shrink per projection made a 16-sequence
    SmolLM2 step 1.5x slower. That packed copy replaces the base's own (the weight is then held twice, packed
    and not), and is packed again when an adapter is loaded into a slot."""

    def __init__(self, base: torch.nn.Module, widths: list[int], context: LoRAContext, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.widths, self.context = base, widths, context
        self.in_features, self.out_features = base.in_features, sum(widths)
        self.max_rank = max_rank
        self.room = max_rank * len(widths)  # rank columns per slot
        rows = context.max_loras * self.room
        self.lora_a = torch.zeros(rows, self.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(rows, self.out_features, dtype=dtype, device=device)
        self.active = [False] * context.max_loras  # slots whose adapter targets this linear
        self.packed = self.bias = None
        if getattr(base, "packed_weight", None) is not None and getattr(base, "weight", None) is not None:
            if base.bias is not None:
                self.bias = torch.cat([base.bias, torch.zeros(rows, dtype=base.bias.dtype, device=device)])
            self._repack()
            base.packed_weight = None  # the fused copy's first rows are the base's weight

    def _repack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([self.base.weight, self.lora_a]), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.context.row_slots
        lora = rows is not None and any(self.active)
        if self.packed is not None:
            flat = x.reshape(-1, self.in_features)
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            base = y[:, :self.out_features]
            if not lora:
                return base.contiguous().view(*x.shape[:-1], self.out_features)
            h = y[:, self.out_features:].mul(self.context.mask(self.room, flat.dtype))
            return torch.addmm(base, h, self.lora_b).view(*x.shape[:-1], self.out_features)
        out = self.base(x)
        if not lora:
            return out
        flat = x.reshape(-1, self.in_features)
        h = torch.nn.functional.linear(flat, self.lora_a).mul_(self.context.mask(self.room, flat.dtype))
        out.view(-1, self.out_features).addmm_(h, self.lora_b)
        return out

    def load(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put an adapter's (A, B) per slice into `slot` (None: it does not target that slice)."""
        start = slot * self.room
        self.lora_a[start:start + self.room].zero_()
        self.lora_b[start:start + self.room].zero_()
        offset = 0
        for i, (width, piece) in enumerate(zip(self.widths, pieces)):
            if piece is not None:
                a, b = piece
                row = start + i * self.max_rank
                self.lora_a[row:row + a.shape[0]].copy_(a)
                self.lora_b[row:row + a.shape[0], offset:offset + width].copy_(b.t())
            offset += width
        self.active[slot] = any(p is not None for p in pieces)
        if self.packed is not None and self.active[slot]:
            self._repack()

    def clear(self, slot: int) -> None:
        self.active[slot] = False


@dataclass(slots=True)
class LoRAStats:
    loads: int = 0  # adapters copied into a device slot
    evictions: int = 0  # ... that replaced another adapter
    reads: int = 0  # adapters read from disk into host memory
    waits: int = 0  # admissions deferred because every slot served a running request
    load_seconds: float = 0.0  # spent copying adapters into slots


class LoRAManager:
    """An engine's adapters: wrappers on its model, `max_loras` device slots, and host copies (LRU, at most
    `max_cpu_loras`). The scheduler `acquire`s a request's adapter as it admits it and `release`s it when the
    request stops running; a slot in use by a running request is never replaced."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.dtype, self.device = dtype, device
        self.context = LoRAContext(max_loras)
        self.targets: dict[tuple[int, str], tuple[LoRALinear, int]] = {}  # (layer, HF name) -> (wrapper, slice)
        self.wrappers = self._install(model)
        self.slots: list[str | None] = [None] * max_loras  # adapter key per slot
        self.pins = [0] * max_loras
        self.lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.host: OrderedDict[str, LoRAWeights] = OrderedDict()
        self._host_lock = threading.Lock()  # a worker prepares requests' adapters off its engine loop's thread
        self.stats = LoRAStats()

    def _install(self, model: torch.nn.Module) -> list[LoRALinear]:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise LoRAError(f"LoRA needs a decoder model with model.layers; {type(model).__name__} has none")
        wrappers = []
        for index, layer in enumerate(layers):
            if hasattr(layer, "qkv_proj") and hasattr(layer, "gate_up_proj") and not hasattr(layer, "self_attn"):
                # a fused CPU layer: q/k/v and gate/up are slices of one projection each
                head_dim = layer.head_dim
                widths = {"qkv_proj": [layer.num_heads * head_dim, layer.num_kv_heads * head_dim,
                                       layer.num_kv_heads * head_dim],
                          "o_proj": [layer.o_proj.out_features],
                          "gate_up_proj": [layer.intermediate_size, layer.intermediate_size],
                          "down_proj": [layer.down_proj.out_features]}
                made = {name: self._wrap(layer, name, w) for name, w in widths.items()}
                for hf_name, (fused, i) in FUSED_SLICES.items():
                    self.targets[(index, hf_name)] = (made[fused], i)
                wrappers += made.values()
                continue
            for block_name in ("self_attn", "mlp"):
                block = getattr(layer, block_name, None)
                for name in TARGETS:
                    child = getattr(block, name, None) if block is not None else None
                    if child is not None and hasattr(child, "in_features") and hasattr(child, "out_features"):
                        wrapper = self._wrap(block, name, [child.out_features])
                        self.targets[(index, f"{block_name}.{name}")] = (wrapper, 0)
                        wrappers.append(wrapper)
        return wrappers

    def _wrap(self, parent: torch.nn.Module, name: str, widths: list[int]) -> LoRALinear:
        wrapper = LoRALinear(getattr(parent, name), widths, self.context, self.max_rank, self.dtype, self.device)
        setattr(parent, name, wrapper)
        return wrapper

    @property
    def weight_bytes(self) -> int:
        return sum(w.lora_a.numel() * w.lora_a.element_size() + w.lora_b.numel() * w.lora_b.element_size()
                   for w in self.wrappers)

    def prepare(self, request: LoRARequest) -> LoRAWeights:
        """The adapter in host memory, read and checked against this model (LoRAError otherwise)."""
        with self._host_lock:
            weights = self.host.get(request.key)
            if weights is not None:
                self.host.move_to_end(request.key)
                return weights
        weights = read_adapter(request, self.max_rank)
        for (layer, module), (a, b) in weights.modules.items():
            target = self.targets.get((layer, module))
            if target is None:
                raise LoRAError(f"adapter {request.name} targets layer {layer} {module}, which this model has no "
                                f"LoRA-capable linear for (supported: the attention and MLP projections)")
            wrapper, i = target
            if a.shape[1] != wrapper.in_features or b.shape[0] != wrapper.widths[i]:
                raise LoRAError(f"adapter {request.name}: layer {layer} {module} is {b.shape[0]}x{a.shape[1]}, "
                                f"the model's is {wrapper.widths[i]}x{wrapper.in_features}: an adapter of another "
                                f"base model")
        with self._host_lock:
            self.stats.reads += 1
            self.host[request.key] = weights
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        return weights

    def slot_of(self, key: str) -> int | None:
        try:
            return self.slots.index(key)
        except ValueError:
            return None

    def acquire(self, request: LoRARequest) -> int | None:
        """A slot holding `request`'s adapter, pinned for one running request; None when every slot is pinned
        by others (the request waits). Raises LoRAError when the adapter can no longer be read."""
        slot = self.slot_of(request.key)
        if slot is None:
            free = [s for s in range(self.max_loras) if self.slots[s] is None]
            if free:
                slot = free[0]
            else:
                unpinned = [s for s in self.lru if not self.pins[s]]
                if not unpinned:
                    self.stats.waits += 1
                    return None
                slot = unpinned[0]
                self.stats.evictions += 1
            self._load(slot, self.prepare(request))
        self.pins[slot] += 1
        self.lru.pop(slot, None)
        self.lru[slot] = None
        return slot

    def release(self, slot: int) -> None:
        self.pins[slot] -= 1

    def _load(self, slot: int, weights: LoRAWeights) -> None:
        started = time.perf_counter()
        pieces: dict[LoRALinear, list] = {w: [None] * len(w.widths) for w in self.wrappers}
        for (layer, module), (a, b) in weights.modules.items():
            wrapper, i = self.targets[(layer, module)]
            pieces[wrapper][i] = (a.to(self.dtype), b.to(self.dtype))
        with torch.no_grad():
            for wrapper, parts in pieces.items():
                wrapper.load(slot, parts)
        self.slots[slot] = weights.request.key
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - started

    def unload(self, name: str) -> bool:
        """Forget adapter `name` in host memory and in any slot no running request uses; True if it was held."""
        held = False
        with self._host_lock:
            for key in [k for k in self.host if k.rpartition("@")[0] == name]:
                del self.host[key]
                held = True
        for slot, key in enumerate(self.slots):
            if key is not None and key.rpartition("@")[0] == name and not self.pins[slot]:
                for wrapper in self.wrappers:
                    wrapper.clear(slot)
                self.slots[slot] = None
                self.lru.pop(slot, None)
                held = True
        return held

    def summary(self, running, waiting) -> dict:
        """What a worker reports (WorkerStats.lora): slots, what they hold, counters, and the adapters of its
        running and waiting requests (vllm:lora_requests_info)."""
        stats = self.stats
        return {"max_loras": self.max_loras, "keys": [k for k in self.slots if k is not None],
                "loads": stats.loads, "evictions": stats.evictions, "reads": stats.reads, "waits": stats.waits,
                "load_seconds": stats.load_seconds,
                "running": dict(Counter(r.lora.name for r in running if r.lora is not None)),
                "waiting": dict(Counter(r.lora.name for r in waiting if r.lora is not None))}

    def set_rows(self, row_slots: list[int] | None) -> None:
        """The next forward's slot per packed row (-1: the base model); None: no row runs an adapter."""
        if row_slots is None or not any(s >= 0 for s in row_slots):
            self.context.set_rows(None)
            return
        self.context.set_rows(torch.tensor(row_slots, dtype=torch.long, device=self.device))


def build_random_adapter(base_dir: str | Path, out_dir: str | Path, seed: int = 0, rank: int = 8,
                         alpha: float = 16.0, target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
                         use_rslora: bool = False, scale: float = 0.2) -> Path:
    """A PEFT LoRA adapter with random A and B (PEFT starts B at zero) on the model at `base_dir`, for tests
    and benchmarks; needs `peft` (a dev dependency)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "adapter_config.json").exists():
        return out_dir
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_model_dir(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The base model with the adapter merged into its weights by PEFT, saved as a HF directory: the
    reference a served adapter's outputs must equal."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return out_dir
