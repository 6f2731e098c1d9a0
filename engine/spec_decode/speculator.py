"""Speculative decoding inside the continuous batch.

Before a step, `propose` gives each speculating request in decode a draft of k tokens (n-gram prompt
lookup); the scheduler runs its row as 1 + k query tokens and the model runner returns logits for every
one of them. `sample` then walks a drafted request's positions in order, exactly as k + 1 plain steps
would: each position is sampled by the engine's own sampler (penalties, bias, min_tokens, grammar
bitmask, top-k/p, the request's seeded generator) and appended as a plain step appends, and the walk
stops at the first sampled token that differs from the draft (or when the request finishes).

For a draft that is a point mass on token d, this is the standard rejection rule: the sampled token
equals d with probability p(d) = min(1, p(d)/q(d)), and otherwise it is distributed as
norm(max(0, p - q)), p with d removed. Every emitted token takes exactly one draw from the request's
generator, so a seeded request gives the same output with speculation as without (and `skip_draws`
still replays a migrated request's draws). The last position gives the bonus token.

KV of rejected positions is rolled back: the computed length is the kept tokens', blocks past it go
back to the pool, and a block is offered to the prefix cache only once every token in it is kept.

How many tokens to draft adapts per request: a draft position i is worth its cost when its chance of
being reached and accepted, acceptance^i, beats the cost of one more query token in a forward against
the time a plain step spends per token. A request whose acceptance makes no position worth it drafts
nothing and keeps measuring its acceptance against a free guess (`shadow`), so it resumes when its text
becomes predictable again.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.reasoning import force_reasoning_end
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.config import EngineConfig
    from engine.outputs import RequestOutput
    from engine.request import Request
    from engine.sampler import Sampler
    from engine.step_costs import StepCosts

COST_ALPHA = 0.2
MAX_THRESHOLD = 0.9  # a request accepting more than this always drafts, which re-measures the token cost
PRIOR_CONTEXT = 512  # the context whose prefill speed prices a draft token before any is measured


def num_drafts(acceptance: float, threshold: float, max_k: int) -> int:
    """How many draft positions pay: position i is reached and accepted with chance acceptance^i, and
    pays when that beats `threshold`."""
    k, reach = 0, acceptance
    while k < max_k and reach > threshold:
        k += 1
        reach *= acceptance
    return k


class Speculator:
    """Drafts, verifies and rolls back on the engine's step loop (Engine.step calls it when it exists).

    It samples with what the engine hands it: `sample` for the rows that drafted nothing (the engine's
    plain sampling, forks included), and `sampler` and `append_token` for each position it verifies."""

    def __init__(self, config: SpeculativeConfig, target: EngineConfig, block_manager: BlockManager,
                 step_costs: StepCosts, sampler: Sampler,
                 sample: Callable[[list[Request], torch.Tensor], list[RequestOutput]],
                 append_token: Callable[[Request, int, dict | None], RequestOutput]):
        self.config = config
        self.block_manager = block_manager
        self.step_costs = step_costs
        self.sampler = sampler
        self.sample_plain = sample
        self.append_token = append_token
        self.stats = SpecDecodeStats()
        self.token_cost_s: float | None = None  # measured seconds one more query token adds to a forward
        self.draft_model = config.method == "draft_model"
        if self.draft_model:
            self.proposer = DraftModelProposer(config, target, block_manager.num_blocks)
        else:
            self.proposer = SuffixProposer(config) if config.method == "suffix" else NgramProposer()

    # ---- before the step ------------------------------------------------------------------------

    def propose(self, running: list[Request]) -> None:
        """Set the drafts (`spec_token_ids`) of the speculating requests about to decode."""
        decoding = [r for r in running if r.spec is not None and r.num_tokens - r.num_computed_tokens == 1]
        if not decoding and not self.draft_model:
            return
        max_k = self.config.num_speculative_tokens
        threshold = self._threshold(len(running)) if decoding and self.config.adaptive else 0.0
        plans = []
        for req in decoding:
            k = num_drafts(req.spec.acceptance, threshold, max_k) if self.config.adaptive else max_k
            plans.append(min(k, req.max_tokens - req.num_output_tokens - 1))
        proposals = self.proposer.propose([(req, max(k, 1)) for req, k in zip(decoding, plans)])
        for req, k, drafts in zip(decoding, plans, proposals):
            state = req.spec
            if drafts and req.structured_output_request is not None:
                drafts = drafts[:req.structured_output_request.matcher.validate_tokens(drafts)]
            state.shadow = drafts[0] if drafts and k < 1 else None
            req.spec_token_ids = drafts if k >= 1 else []

    def _threshold(self, num_decodes: int) -> float:
        """The acceptance chance a draft position needs to pay: one more query token's cost against the
        time a plain step of this batch spends per token it produces."""
        costs = self.step_costs
        token_cost = self.token_cost_s
        if token_cost is None:
            token_cost = 1.0 / costs.prefill_speed(PRIOR_CONTEXT)
        return min(MAX_THRESHOLD, token_cost * num_decodes / costs.decode_time(num_decodes))

    @staticmethod
    def num_logits(scheduled: list[tuple[Request, int]]) -> list[int] | None:
        """Logits each scheduled row needs (1 + its drafts), or None when no row drafted."""
        if not any(req.spec_token_ids for req, _ in scheduled):
            return None
        return [1 + len(req.spec_token_ids) for req, _ in scheduled]

    # ---- after the forward ----------------------------------------------------------------------

    def sample(self, sampled: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample the plain rows as a step without drafts does and verify the drafted ones; one output per request."""
        plain, plain_rows, drafted = [], [], []
        row = 0
        for req in sampled:
            if req.spec_token_ids:
                drafted.append((req, logits[row:row + 1 + len(req.spec_token_ids)]))
                row += 1 + len(req.spec_token_ids)
            else:
                plain.append(req)
                plain_rows.append(row)
                row += 1
        outputs = []
        if plain:
            plain_logits = logits if len(plain_rows) == len(logits) else logits[plain_rows]
            outputs = self.sample_plain(plain, force_reasoning_end(plain_logits, plain))
            self._check_shadows(plain)
        outputs += [self._verify(req, rows) for req, rows in drafted]
        if isinstance(self.proposer, SuffixProposer):
            for req in sampled:
                if req.spec is not None and req.finish_reason in ("stop", "length"):
                    self.proposer.finished(req)
        return outputs

    def _verify(self, req: Request, rows: torch.Tensor) -> RequestOutput:
        bm, sampler, append_token = self.block_manager, self.sampler, self.append_token
        drafts, req.spec_token_ids = req.spec_token_ids, []
        out, num_accepted = None, 0
        for j, row in enumerate(rows):
            req.num_computed_tokens = req.num_tokens  # as a plain step: every token so far has its KV
            bm.cache_full_blocks(req)
            tokens, logprobs = sampler(row.unsqueeze(0), [req])
            step_out = append_token(req, tokens[0], logprobs[0])
            if out is None:
                out = step_out
            else:
                out.extend(step_out)
            accepted = j < len(drafts) and tokens[0] == drafts[j]
            if j < len(drafts):
                req.spec.observe(accepted)
            num_accepted += accepted
            if not accepted or req.finish_reason is not None:
                break
        self.stats.record(len(drafts), num_accepted)
        if req.finish_reason is None:
            bm.truncate(req, req.num_computed_tokens)  # the rejected positions' blocks go back
        return out

    def _check_shadows(self, reqs: list[Request]) -> None:
        for req in reqs:
            if req.spec is not None and req.spec.shadow is not None:
                req.spec.observe(req.all_token_ids[-1] == req.spec.shadow)
                req.spec.shadow = None

    def observe_step(self, shape: tuple[int, int, int], num_logits: list[int], seconds: float) -> None:
        """Measure what a draft token costs from a step that verified drafts (and ran no prompt chunk):
        its time beyond a plain decode step of the same batch, per draft token."""
        decodes, prefill, _ = shape
        drafted = [m for m in num_logits if m > 1]
        if prefill > sum(drafted):
            return
        extra = sum(drafted) - len(drafted)
        plain_s = self.step_costs.decode_time(decodes + len(drafted))
        sample = max(seconds - plain_s, 0.0) / extra
        old = self.token_cost_s
        self.token_cost_s = sample if old is None else old + COST_ALPHA * (sample - old)
