"""Sharding a Llama-family model over the ranks of a TPGroup, as vLLM does it: Q/K/V and gate/up column-parallel
(each rank its heads and its slice of the MLP), o_proj and down_proj row-parallel with one all-reduce each, the
embedding and LM head vocabulary-parallel. KV heads split across ranks, or are replicated when there are fewer
KV heads than ranks. A rank builds the model on the meta device and reads only its slices from the checkpoint's
safetensors, so it never holds the whole model.

What cannot be split exactly is refused before any weight is read, naming the numbers: query heads that do not
divide by the TP size, KV heads that neither divide nor are divided by it, an MLP width that does not divide, an
architecture this file does not know."""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from engine.parallel.group import TPGroup

# Decoder-only models whose layers are q/k/v/o attention and a gated MLP, with nothing else that holds
# heads or vocabulary (norms are replicated; Qwen3's per-head q/k norms too).
SHARDABLE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Rank `rank` of `size`: its query heads, its KV heads (from the first, `kv_heads` of them), its MLP
    columns and its vocabulary rows (`vocab_shard` each; the last rank's padded past `vocab_size`)."""
    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def heads(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_head(self) -> int:
        return self.rank * self.heads

    @property
    def first_kv_head(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.kv_heads
        return self.rank // (self.size // self.num_kv_heads)  # replicated: the KV head its query heads read

    @property
    def mlp_columns(self) -> tuple[int, int]:
        width = self.intermediate_size // self.size
        return self.rank * width, (self.rank + 1) * width

    @property
    def vocab_shard(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_rows(self) -> tuple[int, int]:
        start = self.rank * self.vocab_shard
        return start, min(self.vocab_size, start + self.vocab_shard)


def plan_for(hf_config, rank: int, size: int) -> ShardPlan:
    """The rank's shard of a model of `hf_config`; ValueError naming what does not split."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not any(a in SHARDABLE for a in architectures):
        raise ValueError(f"tensor parallelism supports {', '.join(SHARDABLE)}; this model is "
                         f"{', '.join(architectures) or hf_config.model_type}")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} query heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} neither divides nor is a multiple of the model's "
                         f"{kv_heads} KV heads")
    if hf_config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's MLP width "
                         f"{hf_config.intermediate_size}")
    return ShardPlan(rank, size, heads, kv_heads, head_dim, hf_config.intermediate_size, hf_config.vocab_size)


class VocabParallelEmbedding(torch.nn.Module):
    """The rank's rows of the embedding; ids outside them look up zeros, and the ranks' sum is the embedding."""

    def __init__(self, plan: ShardPlan, hidden_size: int, group: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.start, self.end = plan.vocab_rows
        self.group = group
        self.weight = torch.nn.Parameter(torch.empty(plan.vocab_shard, hidden_size, dtype=dtype, device="meta"),
                                         requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)
        out = F.embedding((input_ids - self.start).masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class VocabParallelHead(torch.nn.Module):
    """The rank's rows of the LM head: rank 0 gathers every rank's logits into the whole vocabulary (padding cut
    off); the other ranks return their own, which nobody reads."""

    def __init__(self, plan: ShardPlan, hidden_size: int, group: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = plan.vocab_size
        self.group = group
        self.weight = torch.nn.Parameter(torch.empty(plan.vocab_shard, hidden_size, dtype=dtype, device="meta"),
                                         requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()
        shards = self.group.gather_to_first(local)
        return local if shards is None else torch.cat(shards, dim=-1)[..., :self.vocab_size]


class RowParallel(torch.nn.Module):
    """A row-parallel projection (o_proj, down_proj) whatever computes it (nn.Linear, oneDNN, blocks): the ranks'
    partial outputs are summed. Only rank 0 holds its bias, so it is added once."""

    def __init__(self, inner: torch.nn.Module, group: TPGroup):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


def _linear_like(linear: torch.nn.Linear, in_features: int, out_features: int) -> torch.nn.Linear:
    return torch.nn.Linear(in_features, out_features, bias=linear.bias is not None, device="meta",
                           dtype=linear.weight.dtype)


def load_sharded(model_dir: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str,
                 group: TPGroup):
    """The model with this rank's shard of every weight, read slice by slice from the safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_dir)
    plan = plan_for(hf_config, group.rank, group.size)
    files = _safetensors(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    hidden = hf_config.hidden_size
    q_rows, kv_rows = plan.heads * plan.head_dim, plan.kv_heads * plan.head_dim
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _linear_like(attn.q_proj, hidden, q_rows)
        attn.k_proj = _linear_like(attn.k_proj, hidden, kv_rows)
        attn.v_proj = _linear_like(attn.v_proj, hidden, kv_rows)
        attn.o_proj = _linear_like(attn.o_proj, q_rows, attn.o_proj.out_features)
        width = plan.intermediate_size // plan.size
        mlp.gate_proj = _linear_like(mlp.gate_proj, hidden, width)
        mlp.up_proj = _linear_like(mlp.up_proj, hidden, width)
        mlp.down_proj = _linear_like(mlp.down_proj, width, mlp.down_proj.out_features)
    model.model.embed_tokens = VocabParallelEmbedding(plan, hidden, group, dtype)
    model.lm_head = VocabParallelHead(plan, hidden, group, dtype)
    rotary = model.model.rotary_emb
    others = [name for name, _ in model.named_buffers() if not name.startswith("model.rotary_emb.")]
    if others:
        raise ValueError(f"tensor parallelism cannot shard this model's buffers {others}")
    model.to_empty(device=device)
    model.model.rotary_emb = type(rotary)(config=hf_config).to(device)  # its buffers are computed, not stored
    tied = getattr(hf_config, "tie_word_embeddings", False)
    with ExitStack() as stack:  # each file opened once
        opened = {path: stack.enter_context(safe_open(path, framework="pt")) for path in set(files.values())}
        for name, param in model.named_parameters():
            if tied and name == "lm_head.weight":
                continue
            with torch.no_grad():
                param.copy_(_read_shard(opened, files, name, plan))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), plan


def _safetensors(model_dir: Path) -> dict[str, Path]:
    """Each weight's file."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ValueError(f"tensor parallelism reads safetensors checkpoints; {model_dir} has none")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _read_shard(opened: dict, files: dict[str, Path], name: str, plan: ShardPlan) -> torch.Tensor:
    """This rank's slice of the checkpoint's `name` (`opened`: each file's open safetensors handle)."""
    source = name
    if name == "lm_head.weight" and name not in files:
        source = "model.embed_tokens.weight"
    if source not in files:
        raise ValueError(f"the checkpoint has no weight {source!r}")
    full = opened[files[source]].get_slice(source)
    rows = _rows(name, plan)
    if rows is None:
        return _maybe_bias(name, plan, full[:])
    start, end = rows
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full[:, start:end]
    piece = full[start:end]
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        pad = plan.vocab_shard - (end - start)
        if pad:
            piece = torch.cat([piece, piece.new_zeros(pad, *piece.shape[1:])])
    return piece


def _maybe_bias(name: str, plan: ShardPlan, tensor: torch.Tensor) -> torch.Tensor:
    """A row-parallel bias counts once: ranks other than 0 hold zeros."""
    if name.endswith(("o_proj.bias", "down_proj.bias")) and plan.rank:
        return torch.zeros_like(tensor)
    return tensor


def _rows(name: str, plan: ShardPlan) -> tuple[int, int] | None:
    """The slice of dimension 0 (of dimension 1 for o_proj and down_proj weights) this rank holds; None: all."""
    d = plan.head_dim
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return plan.first_head * d, (plan.first_head + plan.heads) * d
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return plan.first_kv_head * d, (plan.first_kv_head + plan.kv_heads) * d
    if name.endswith("o_proj.weight"):
        return plan.first_head * d, (plan.first_head + plan.heads) * d
    if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias", "down_proj.weight")):
        return plan.mlp_columns
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return plan.vocab_rows
    return None


def row_parallel(model: torch.nn.Module, group: TPGroup) -> None:
    """Wrap each decoder layer's o_proj and down_proj, whatever computes them by now (HF's layer or the fused
    one), so that their partial sums are all-reduced."""
    for layer in model.model.layers:
        for owner in (layer, getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
            for attr in ("o_proj", "down_proj"):
                inner = getattr(owner, attr, None) if owner is not None else None
                if inner is not None and not isinstance(inner, RowParallel):
                    setattr(owner, attr, RowParallel(inner, group))
