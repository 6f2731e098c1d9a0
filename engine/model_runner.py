"""Runs the HF model on a packed batch of scheduled tokens against the paged KV cache."""
from __future__ import annotations

import dataclasses
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine import cpu_kernels
from engine.cpu_layers import fuse_decoder_layers, use_onednn_linears
from engine.attention import ATTN_IMPLEMENTATION, AttentionMetadata, DecodeGroup, PagedDecodes, PrefillSegment
from engine.config import EngineConfig
from engine.kv_cache import KVCache, KVLayout
from engine.model_loader import load_model
from engine.model_support import check_model_dir, every_layer_window
from engine.parallel.group import TPGroup
from engine.request import Request


@dataclass(slots=True)
class StepPlan:
    """A step's work as plain data, per scheduled request: the tokens it computes from position `starts[i]`,
    the blocks its context covers, and whether it is a decode (`decodes`, longest context first). Rank 0 of a
    tensor-parallel engine sends it, with the positions to keep logits at, to the other ranks."""
    token_ids: list[list[int]]
    starts: list[int]
    tables: list[list[int]]
    decodes: list[int]
    loras: list[int] | None = None  # each request's LoRA slot (-1: the base model); None: no adapter in the step


@dataclass(slots=True)
class PackedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    last_token_idx: list[int]
    lora_rows: list[int] | None = None  # each packed row's LoRA slot, when the step runs an adapter


class ModelRunner:
    """Owns the model and the KV cache; `execute` turns scheduled work into logits for sampled positions.

    With `tp` (a rank of a tensor-parallel engine, engine/parallel/) it holds that rank's shard of the model and
    of the KV cache (its KV heads). Rank 0 runs `execute`, which first sends the step's plan to the other ranks;
    they run `follow`, doing each forward with it."""

    def __init__(self, config: EngineConfig, model_dir: Path, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp
        self.device = config.torch_device if tp is None else tp.device
        self._pending_copies: list[tuple[int, int]] = []
        check_model_dir(model_dir)  # before the weights: a model the attention cannot run exactly is refused
        shard = None
        if tp is None:
            self.model = load_model(model_dir, config.torch_dtype, self.device, ATTN_IMPLEMENTATION)
        else:
            from engine.parallel.sharding import load_sharded
            self.model, shard = load_sharded(model_dir, config.torch_dtype, self.device, ATTN_IMPLEMENTATION, tp)
        # The weights this rank holds, as loaded (before the CPU path repacks them).
        self.weight_bytes = sum(t.numel() * t.element_size() for t in {id(p): p for p in self.model.parameters()}.values())
        self.fused_layers = 0  # decoder layers running on engine/cpu_layers.py's fused path
        if (self.device.type == "cpu" and torch.backends.mkldnn.is_available()
                and (config.torch_dtype == torch.float32
                     or config.torch_dtype == torch.bfloat16 and cpu_kernels.onednn_packs_bf16())):
            blocks = config.weight_blocks and config.torch_dtype == torch.float32
            # LoRA packs its adapters' A beside each projection's weight (engine/lora.py): those keep theirs
            self.fused_layers = fuse_decoder_layers(self.model, blocks, keep_weights=config.enable_lora)
            use_onednn_linears(self.model, blocks, keep_weights=config.enable_lora)
        self.lora = None  # the adapters' slots and wrappers (engine/lora.py), with enable_lora
        if config.enable_lora:
            from engine.lora import LoRAManager
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                    config.torch_dtype, self.device)
        hf = self.model.config
        if tp is not None:
            from engine.parallel.sharding import row_parallel
            row_parallel(self.model, tp)  # around whatever computes o_proj and down_proj by now
            # A step's all-reduces carry at most its tokens' hidden states, its gather a vocabulary shard of logits
            # per sampled row (two per sequence: a decode and a draft, or a prompt's last token; more go over the
            # process group, counted), fp32 at most; and 1 MiB for the plan.
            rows = 2 * config.max_num_seqs
            tp.attach_shared_memory(4 * max(config.max_num_batched_tokens * hf.hidden_size,
                                            rows * shard.vocab_shard) + (1 << 20))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.layout = KVLayout(model_id=config.model_id, dtype=config.resolved_dtype, block_size=config.block_size,
                               num_layers=hf.num_hidden_layers, num_kv_heads=hf.num_key_value_heads,
                               head_dim=head_dim)
        self.kv_cache = self._kv_cache(config, shard)
        self.vocab_size = hf.vocab_size
        # every layer's sliding window, when all have one: blocks out of it are given back as requests advance
        self.release_window = every_layer_window(hf)
        self.max_position_embeddings = getattr(hf, "max_position_embeddings", 2048)
        self._gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        # On CPU fp32 and bf16 decodes are attended in place by the C kernel; elsewhere by gather + SDPA.
        self.paged_kernel = (self.device.type == "cpu" and config.torch_dtype in (torch.float32, torch.bfloat16)
                             and cpu_kernels.available())
        # and prompt chunks by its prefill kernel where it beats torch's fused SDPA (not in bf16 on CPUs with AMX),
        # or where SDPA cannot do the model's attention (soft-capped scores: HF's eager math in fp32 instead)
        self.prefill_kernel = self.paged_kernel and cpu_kernels.prefill_available(head_dim) and (
            cpu_kernels.prefill_kernel_wins(config.torch_dtype) or getattr(hf, "attn_logit_softcapping", None) is not None)
        # On CUDA, SDPA may pick cuDNN, which plans each new shape on the host (2-2.5 ms per call on an H200,
        # 30 calls a step; a decode's context grows every step, so it never reuses a plan): 60% of a step's
        # host time. Flash and memory-efficient attention launch in microseconds.
        self.sdpa_backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
                              if self.device.type == "cuda" else None)
        # Every rank's weight bytes, in rank order (rank 0's runner only; [own] without tensor parallelism).
        self.rank_weight_bytes = [self.weight_bytes]
        if tp is not None:
            gathered = tp.gather_to_first(torch.tensor([self.weight_bytes], dtype=torch.long))
            self.rank_weight_bytes = None if gathered is None else [int(t.item()) for t in gathered]

    def _kv_cache(self, config: EngineConfig, shard) -> KVCache:
        """The KV cache: this engine's, or on CPU the ranks' one shared cache (each computes on its own heads'
        slot, and rank 0 moves whole blocks of every head; engine/kv_cache.py). Ranks on separate GPUs each hold
        a cache of their own heads (the layout says so), which KV transfer cannot move yet."""
        tp = self.tp
        size = 1 if tp is None else tp.size
        if tp is not None and self.device.type != "cpu":
            self.layout = dataclasses.replace(self.layout, num_kv_heads=shard.kv_heads)
            size = 1
        num_blocks = config.num_kv_blocks or KVCache.num_blocks_for_budget(
            self.layout, config.kv_cache_memory_gb * 2**30, size)
        if size == 1:
            return KVCache(self.layout, num_blocks, self.device, shared=config.kv_cache_shared)
        if tp.rank == 0:
            cache = KVCache(self.layout, num_blocks, self.device, tp=(size, 0))
            tp.store.set("tp/kv", f"{os.getpid()},{cache.shm_fd}")
            return cache
        pid, fd = (int(x) for x in tp.store.get("tp/kv").decode().split(","))
        return KVCache(self.layout, num_blocks, self.device, tp=(size, tp.rank), source=(pid, fd))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (src, dst) before the next forward: here now, on the other ranks with the next plan."""
        self.kv_cache.copy_blocks(copies)
        if self.tp is not None:
            self._pending_copies.extend(copies)

    def follow(self) -> None:
        """A rank other than 0: run each forward rank 0 sends, until it sends None."""
        while (message := self.tp.broadcast_object()) is not None:
            plan, keep, copies = message
            self.kv_cache.copy_blocks(copies)
            self.forward(self.pack(plan), self._tensor(keep))

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], sample_mask: list[bool],
                num_logits: list[int] | None = None) -> torch.Tensor:
        """Logits [num_sampled, vocab] for the requests whose last scheduled token completes their tokens;
        with `num_logits`, each sampled row's last `num_logits[i]` positions (a decode verifying a draft)."""
        plan = self.plan(scheduled)
        batch = self.pack(plan)
        if num_logits is None:
            keep = [i for i, s in zip(batch.last_token_idx, sample_mask) if s]
        else:
            keep = [p for i, s, m in zip(batch.last_token_idx, sample_mask, num_logits) if s
                    for p in range(i - m + 1, i + 1)]
        if self.tp is None:
            return self.forward(batch, self._tensor(keep))
        copies, self._pending_copies = self._pending_copies, []
        try:
            self.tp.broadcast_object((plan, keep, copies))
            return self.forward(batch, self._tensor(keep))
        except RuntimeError as e:
            raise self.tp.failed(e) from e

    def plan(self, scheduled: list[tuple[Request, int]]) -> StepPlan:
        """The step's tokens and blocks per request. Decodes are listed longest context first, so attention
        can take them in a few slices. With the CPU kernel, a decode verifying a draft is decodes too: its
        token at position p attends positions [0, p] of the same block table, as a one-token decode of a
        context p + 1 long would."""
        decodes = sorted((i for i, (req, n) in enumerate(scheduled)
                          if req.num_computed_tokens > 0 and (n == 1 or self._paged_draft(req, n))),
                         key=lambda i: -scheduled[i][0].num_computed_tokens)
        bs = self.config.block_size
        plan = StepPlan([], [], [], decodes)
        if self.lora is not None and any(req.lora_slot >= 0 for req, _ in scheduled):
            plan.loras = [req.lora_slot for req, _ in scheduled]
        for req, num_new in scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
            plan.token_ids.append(req.all_token_ids[start:end] if not req.spec_token_ids
                                  else (req.all_token_ids + req.spec_token_ids)[start:end])
            plan.starts.append(start)
            plan.tables.append(req.block_table[:-(-end // bs)])
        return plan

    def pack(self, plan: StepPlan) -> PackedBatch:
        """Pack the planned tokens of all requests into one sequence, decodes first, with its attention metadata."""
        is_decode = set(plan.decodes)
        input_ids, positions, slots = [], [], []
        last_token_idx = [0] * len(plan.starts)
        tables, lens, prefills = [], [], []
        lora_rows = None if plan.loras is None else []
        bs = self.config.block_size
        for i in plan.decodes + [i for i in range(len(plan.starts)) if i not in is_decode]:
            ids, start, table = plan.token_ids[i], plan.starts[i], plan.tables[i]
            num_new, offset = len(ids), len(input_ids)
            end = start + num_new
            input_ids.extend(ids)
            if lora_rows is not None:
                lora_rows += [plan.loras[i]] * num_new
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            last_token_idx[i] = offset + num_new - 1
            if i in is_decode:
                tables += [table] * num_new
                lens += range(start + 1, end + 1)
            else:
                prefills.append(self._prefill_segment(offset, num_new, end, table))
        paged = self._paged_decodes(tables, lens) if self.paged_kernel and tables else None
        decode_groups = [] if paged is not None else self._decode_groups(tables, lens)
        gathered = [len(g.block_ids) for g in decode_groups]
        gathered += [len(seg.block_ids) for seg in prefills if seg.block_ids is not None and not seg.paged]
        workspace = self._workspace(max(gathered)) if gathered else None
        md = AttentionMetadata(self.kv_cache, self._tensor(slots), decode_groups, prefills, workspace, paged)
        return PackedBatch(self._tensor(input_ids), self._tensor(positions), md, last_token_idx, lora_rows)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, keep: torch.Tensor) -> torch.Tensor:
        """Run the model on a packed batch; logits only at the positions in `keep`."""
        if self.lora is not None:
            self.lora.set_rows(batch.lora_rows)
        with sdpa_kernel(self.sdpa_backends) if self.sdpa_backends else nullcontext():
            out = self.model(input_ids=batch.input_ids.unsqueeze(0), position_ids=batch.positions.unsqueeze(0),
                             use_cache=False, logits_to_keep=keep, tandem_attn=batch.attn_metadata)
        return out.logits[0].float()

    def _prefill_segment(self, offset: int, num_new: int, context_len: int, table: list[int]) -> PrefillSegment:
        seg = PrefillSegment(offset, offset + num_new, context_len)
        if self.prefill_kernel:  # its own K/V are in the blocks by then: the table covers the whole context
            seg.block_ids, seg.paged = self._tensor(table), True
        elif context_len > num_new:  # a cached or earlier-computed prefix: attend it through the block table
            seg.block_ids = self._tensor(table)
            causal = torch.ones(num_new, context_len, dtype=torch.bool, device=self.device)
            seg.mask = causal.tril(context_len - num_new)
        return seg

    def _paged_draft(self, req: Request, num_new: int) -> bool:
        return self.paged_kernel and num_new == 1 + len(req.spec_token_ids)

    def _paged_decodes(self, tables: list[list[int]], lens: list[int]) -> PagedDecodes:
        padded = self._padded_tables(tables).view(len(tables), max(map(len, tables)))
        return PagedDecodes(len(tables), padded, self._tensor(lens), max(lens))

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split decodes (sorted longest first) where a table is under half the group's widest, so
        padding never more than doubles the KV a group gathers."""
        groups, first = [], 0
        for i in range(1, len(tables) + 1):
            if i == len(tables) or 2 * len(tables[i]) < len(tables[first]):
                groups.append(self._decode_group(first, tables[first:i], lens[first:i]))
                first = i
        return groups

    def _decode_group(self, start: int, tables: list[list[int]], lens: list[int]) -> DecodeGroup:
        block_ids = self._padded_tables(tables)
        mask = None
        if lens[-1] != lens[0]:
            span = torch.arange(lens[0], device=self.device)
            mask = (span.unsqueeze(0) < self._tensor(lens).unsqueeze(1))[:, None, None, :]
        return DecodeGroup(start, start + len(tables), block_ids, lens[0], mask, lens)

    def _padded_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables padded with block 0 to the widest one's width, flattened."""
        width = max(map(len, tables))
        return self._tensor([b for t in tables for b in t + [0] * (width - len(t))])

    def _workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers for gathering `num_blocks` blocks, kept across steps so attention never allocates them."""
        if self._gather_buffers is None or len(self._gather_buffers[0]) < num_blocks:
            k = self.kv_cache.k[0]
            shape = (num_blocks, *k.shape[1:])
            self._gather_buffers = (torch.empty(shape, dtype=k.dtype, device=k.device),
                                    torch.empty(shape, dtype=k.dtype, device=k.device))
        return self._gather_buffers

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
