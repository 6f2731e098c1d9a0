"""Draft-model proposals: a smaller model of the same tokenizer drafts greedily, run by its own ModelRunner
on its own KV cache (no prefix caching). A greedy draft is a point mass, so the target's verification
(speculator.py) keeps the target's distribution exactly as for n-gram drafts."""
from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model_loader import resolve_model_dir
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class DraftSequence:
    """The draft model's copy of one target request: its tokens (the target's, then the last draft) and
    KV; `synced` tokens of it are known to equal the target's."""
    seq: Request
    synced: int


class DraftModelProposer:
    """Drafts for a batch of requests in k packed forwards of the draft model (the first also catches up on
    the tokens the target accepted since). KV the draft computed for tokens the target rejected is dropped:
    a sequence's computed length falls back to the tokens it shares with its target request."""

    def __init__(self, config: SpeculativeConfig, target: EngineConfig, num_blocks: int):
        draft = EngineConfig(model=config.model, dtype=target.dtype, device=target.device, block_size=target.block_size,
                             num_kv_blocks=num_blocks, enable_prefix_caching=False, num_threads=target.num_threads)
        self.runner = ModelRunner(draft, resolve_model_dir(config.model))
        self.block_manager = BlockManager(self.runner.kv_cache.num_blocks, target.block_size, False)
        self.sequences: dict[Request, DraftSequence] = {}

    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k greedy draft tokens for each (request, k); sequences of requests not in `batch` are freed."""
        for req in [r for r in self.sequences if all(r is not b for b, _ in batch)]:
            self.block_manager.free(self.sequences.pop(req).seq)
        seqs = [self._sync(req) for req, _ in batch]
        drafts: list[list[int]] = [[] for _ in batch]
        active = list(range(len(batch)))
        while active:
            scheduled = []
            for i in list(active):
                seq = seqs[i]
                num_new = seq.num_tokens - seq.num_computed_tokens
                if not self.block_manager.allocate_slots(seq, num_new):  # the draft cache is full: no draft
                    active.remove(i)
                    continue
                scheduled.append((seq, num_new))
            if not scheduled:
                break
            tokens = self.runner.execute(scheduled, [True] * len(scheduled)).argmax(dim=-1).tolist()
            for i, (seq, num_new), token in zip(active, scheduled, tokens):
                seq.num_computed_tokens += num_new
                seq.all_token_ids.append(token)
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < batch[i][1]]
        return drafts

    def _sync(self, req: Request) -> Request:
        """The draft sequence of `req` holding its tokens, with KV only for those it shares with them."""
        entry = self.sequences.get(req)
        if entry is None:
            entry = self.sequences[req] = DraftSequence(Request(req.request_id, req.prompt_token_ids, GREEDY,
                                                                req.max_tokens), 0)
        seq, target = entry.seq, req.all_token_ids
        common = entry.synced
        while common < min(len(seq.all_token_ids), len(target)) and seq.all_token_ids[common] == target[common]:
            common += 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, common)
        self.block_manager.truncate(seq, seq.num_computed_tokens)
        seq.all_token_ids = list(target)
        entry.synced = len(target)
        return seq
