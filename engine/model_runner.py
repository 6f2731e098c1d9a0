"""Runs the HF model on a packed batch of scheduled tokens against the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import ATTN_IMPLEMENTATION, AttentionMetadata, PrefillSegment
from engine.config import EngineConfig
from engine.kv_cache import KVCache, KVLayout
from engine.model_loader import load_model
from engine.request import Request


@dataclass(slots=True)
class PackedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    last_token_idx: list[int]


class ModelRunner:
    """Owns the model and the KV cache; `execute` turns scheduled work into logits for sampled positions."""

    def __init__(self, config: EngineConfig, model_dir: Path):
        self.config = config
        self.device = config.torch_device
        self.model = load_model(model_dir, config.torch_dtype, self.device, ATTN_IMPLEMENTATION)
        hf = self.model.config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.layout = KVLayout(model_id=config.model_id, dtype=config.dtype, block_size=config.block_size,
                               num_layers=hf.num_hidden_layers, num_kv_heads=hf.num_key_value_heads,
                               head_dim=head_dim)
        num_blocks = config.num_kv_blocks or KVCache.num_blocks_for_budget(
            self.layout, config.kv_cache_memory_gb * 2**30)
        self.kv_cache = KVCache(self.layout, num_blocks, self.device)
        self.vocab_size = hf.vocab_size
        self.max_position_embeddings = getattr(hf, "max_position_embeddings", 2048)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], sample_mask: list[bool]) -> torch.Tensor:
        """Logits [num_sampled, vocab] for the requests whose last scheduled token completes their tokens."""
        batch = self.prepare(scheduled)
        keep = [i for i, s in zip(batch.last_token_idx, sample_mask) if s]
        return self.forward(batch, self._tensor(keep))

    def prepare(self, scheduled: list[tuple[Request, int]]) -> PackedBatch:
        """Pack the scheduled tokens of all requests into one sequence with its attention metadata."""
        input_ids, positions, slots, last_token_idx = [], [], [], []
        decode_idx, decode_tables, decode_lens, prefills = [], [], [], []
        bs = self.config.block_size
        for req, num_new in scheduled:
            start, end, offset = req.num_computed_tokens, req.num_computed_tokens + num_new, len(input_ids)
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = req.block_table[:-(-end // bs)]
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if num_new == 1 and start > 0:
                decode_idx.append(offset)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(PrefillSegment(offset, offset + num_new, end, self._tensor(table)))
            last_token_idx.append(offset + num_new - 1)
        md = AttentionMetadata(self.kv_cache, self._tensor(slots), None, None, None, prefills)
        if decode_idx:
            md.decode_token_idx = self._tensor(decode_idx)
            md.decode_block_tables, md.decode_mask = self._pad_tables(decode_tables, decode_lens)
        return PackedBatch(self._tensor(input_ids), self._tensor(positions), md, last_token_idx)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, keep: torch.Tensor) -> torch.Tensor:
        """Run the model on a packed batch; logits only at the positions in `keep`."""
        out = self.model(input_ids=batch.input_ids.unsqueeze(0), position_ids=batch.positions.unsqueeze(0),
                         use_cache=False, logits_to_keep=keep, tandem_attn=batch.attn_metadata)
        return out.logits[0].float()

    def _pad_tables(self, tables: list[list[int]], lens: list[int]):
        width = max(len(t) for t in tables)
        padded = self._tensor([t + [0] * (width - len(t)) for t in tables])
        lens_t = self._tensor(lens)
        span = torch.arange(width * self.config.block_size, device=self.device)
        mask = (span.unsqueeze(0) < lens_t.unsqueeze(1))[:, None, None, :]
        return padded, mask

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
