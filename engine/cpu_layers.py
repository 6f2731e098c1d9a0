"""The CPU path's model layers: oneDNN linears with prepacked weights, and Llama-family decoder layers
whose elementwise ops run as fused C kernels (engine/csrc/fused_ops.c).

HF's decoder layer, run as written, issues ~60 torch ops per layer per forward: separate Q, K, V and gate,
up projections, an RMSNorm as six ops, rotary embedding as eight. At decode sizes each op's dispatch and
allocation is most of its time. `FusedDecoderLayer` computes the same layer with one QKV and one gate-up
projection, RMSNorm with the residual add folded in, rotary embedding in place and SiLU-and-mul, each one
C call, and keeps the residual stream in place. It computes what HF's layer computes, rounding where HF
rounds; attention is the engine's paged attention, as before.
"""
from __future__ import annotations

import torch

from engine import cpu_kernels, weight_blocks
from engine.attention import paged_attention

# Decoder layers with Llama's structure: pre-norm RMSNorm, attention with q/k/v/o projections (bias allowed,
# no q/k norms), a gated SiLU MLP.
FUSABLE_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")


class OneDNNLinear(torch.nn.Module):
    """An nn.Linear computed by oneDNN with its weight packed once at load time, as vLLM's CPU backend
    does. For fp32 torch calls MKL, which on the dev box's AMD EPYC ran the model's GEMMs 1.15-1.9x
    slower than this (bench/HISTORY.md, "Offline engine"); in bf16 on AMX cores the packed weights made a
    256-token SmolLM2 prefill 1.4-1.8x and a lone decode step 1.5x faster than torch's own bf16 linear."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # `keep_weight`: the weight unpacked too, for a LoRA wrapper to pack its adapters' A beside (engine/lora.py)
        self.weight = linear.weight.detach() if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class BlockLinear(torch.nn.Module):
    """A linear whose fp32 weights are exactly 4- or 8-bit blocks (engine/weight_blocks.py): up to
    BLOCK_ROWS rows (a decode step's) are computed from the packed blocks, decoded in registers
    (engine/csrc/block_linear.c), reading a fifth of the fp32 bytes; longer inputs (prefills) run on
    oneDNN's fp32 GEMM, which is faster when every weight serves many rows."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor, kind: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed, self.kind = packed, kind
        self.dense = OneDNNLinear(linear)
        self.bias = self.dense.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > BLOCK_ROWS:
            return self.dense(x)
        flat = x.reshape(rows, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(rows, self.out_features, dtype=x.dtype)
        cpu_kernels.block_linear(out, flat, self.packed, self.kind)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)


# Rows up to which BlockLinear beats oneDNN's fp32 GEMM (bench/HISTORY.md, "Weights as shipped").
BLOCK_ROWS = 32


def _linear(linear: torch.nn.Linear, blocks: bool, keep_weight: bool = False) -> torch.nn.Module:
    """A BlockLinear where `blocks` is asked for, the kernel runs here and the weight is blocks; else a
    OneDNNLinear (keeping its weight unpacked too with `keep_weight`)."""
    if keep_weight:
        return OneDNNLinear(linear, keep_weight=True)
    if blocks and cpu_kernels.blocks_available():
        packed = weight_blocks.pack(linear.weight)
        if packed is not None:
            return BlockLinear(linear, *packed)
    return OneDNNLinear(linear)


def use_onednn_linears(model: torch.nn.Module, blocks: bool = False, keep_weights: bool = False) -> None:
    """Swap every nn.Linear of a CPU fp32 or bf16 model for a OneDNNLinear holding the same weights (with
    `blocks`, a BlockLinear where the weight is 4- or 8-bit blocks; with `keep_weights`, decoder layers' linears
    keep their weights unpacked too, for LoRA)."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        keep = keep_weights and ".layers." in f".{name}"
        setattr(model.get_submodule(parent_name), attr, _linear(linear, blocks, keep))


def _packed(*linears: torch.nn.Linear, blocks: bool = False, keep_weight: bool = False) -> torch.nn.Module:
    """One OneDNNLinear computing the given linears side by side (their outputs concatenated)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None,
                            dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if biases[0] is not None:
            fused.bias.copy_(torch.cat([b.detach() for b in biases]))
    return _linear(fused, blocks, keep_weight)


def _fusable(layer: torch.nn.Module) -> bool:
    if type(layer).__name__ not in FUSABLE_LAYERS:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    config = attn.config
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (all(type(lin) is torch.nn.Linear for lin in linears)
            and len({lin.bias is None for lin in linears[:3]}) == 1 and len({lin.bias is None for lin in linears[4:6]}) == 1
            and getattr(config, "hidden_act", None) == "silu"
            and not hasattr(attn, "q_norm") and not hasattr(attn, "k_norm")
            and all(hasattr(n, "variance_epsilon") and getattr(n, "weight", None) is not None for n in norms)
            and attn.head_dim % 2 == 0)


class FusedDecoderLayer(torch.nn.Module):
    """A Llama-family decoder layer on the fused CPU kernels (see the module docstring)."""

    def __init__(self, layer: torch.nn.Module, blocks: bool = False, keep_weights: bool = False):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attn.layer_idx  # what paged_attention reads from its module
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = attn.scaling
        # HF's layer holds its window (Qwen2: None on full-attention layers) or reads the config's (Mistral)
        self.sliding_window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        keep = keep_weights
        self.qkv_proj = _packed(attn.q_proj, attn.k_proj, attn.v_proj, blocks=blocks, keep_weight=keep)
        self.o_proj = _linear(attn.o_proj, blocks, keep)
        self.gate_up_proj = _packed(mlp.gate_proj, mlp.up_proj, blocks=blocks, keep_weight=keep)
        self.down_proj = _linear(mlp.down_proj, blocks, keep)
        self.intermediate_size = mlp.gate_proj.out_features
        self.input_norm_weight = layer.input_layernorm.weight.detach()
        self.input_norm_eps = layer.input_layernorm.variance_epsilon
        self.post_norm_weight = layer.post_attention_layernorm.weight.detach()
        self.post_norm_eps = layer.post_attention_layernorm.variance_epsilon

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        width = hidden_states.shape[-1]
        residual = hidden_states.reshape(-1, width)  # updated in place: the layer's residual stream
        tokens, dim, heads, kv_heads = residual.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        normed = torch.empty_like(residual)
        cpu_kernels.rms_norm(normed, residual, self.input_norm_weight, self.input_norm_eps)
        qkv = self.qkv_proj(normed)
        cos, sin = (t.reshape(tokens, dim).contiguous() for t in position_embeddings)
        cpu_kernels.rope(qkv, cos, sin, heads + kv_heads, dim)  # Q's heads then K's: adjacent in each row
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        query = qkv[:, :q_end].view(tokens, heads, dim).transpose(0, 1).unsqueeze(0)
        key = qkv[:, q_end:k_end].view(tokens, kv_heads, dim).transpose(0, 1).unsqueeze(0)
        value = qkv[:, k_end:].view(tokens, kv_heads, dim).transpose(0, 1).unsqueeze(0)
        attn_out, _ = paged_attention(self, query, key, value, attention_mask, scaling=self.scaling, **kwargs)
        attn_out = self.o_proj(attn_out.reshape(tokens, heads * dim))
        cpu_kernels.rms_norm(normed, attn_out, self.post_norm_weight, self.post_norm_eps, residual=residual)
        gate_up = self.gate_up_proj(normed)
        act = torch.empty(tokens, self.intermediate_size, dtype=gate_up.dtype)
        cpu_kernels.silu_and_mul(act, gate_up)
        residual.add_(self.down_proj(act))
        return residual.view(hidden_states.shape)


def fuse_decoder_layers(model: torch.nn.Module, blocks: bool = False, keep_weights: bool = False) -> int:
    """Swap each fusable decoder layer of a CPU fp32/bf16 model for a FusedDecoderLayer; returns how many
    were. Without the C kernels (no compiler, or TANDEM_CPU_KERNELS=0) none is: the layers stay HF's.
    Runs before anything hooks the layers (engine/layer_progress.py hooks whatever `layers` holds).
    `keep_weights`: the projections keep their weights unpacked too (for LoRA, engine/lora.py)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not cpu_kernels.fused_available():
        return 0
    fused = 0
    for i, layer in enumerate(layers):
        if _fusable(layer):
            layers[i] = FusedDecoderLayer(layer, blocks, keep_weights)
            fused += 1
    return fused
