"""Turns logits into tokens: penalties, bias, temperature, min-p/top-k/top-p, seeded sampling, logprobs."""
from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputManager, apply_grammar_bitmask


class Sampler:
    """Samples one token per request. Each request draws from its own generator, so seeded
    requests give the same tokens whatever else is in the batch. Rows with a structured output get
    their grammar's bitmask, all in one tensor, after penalties and bias and before temperature."""

    def __init__(self, eos_token_ids: set[int], structured: StructuredOutputManager | None = None):
        self.eos_token_ids = eos_token_ids
        self.structured = structured

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict | None]]:
        """A token (and a logprobs entry, or None) per row. Penalties, bias, min_tokens bans and grammar
        masks are written into `logits` in place: no copy of a [rows, vocab] tensor per step."""
        want_logprobs = [r.sampling_params.logprobs is not None for r in reqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        constrained = [i for i, r in enumerate(reqs) if r.structured_output_request is not None]
        adjusted = [i for i, r in enumerate(reqs) if _adjusts(r.sampling_params)]
        banned = [(i, t) for i, r in enumerate(reqs) for t in self._banned(r)]
        for i in adjusted:
            self._adjust(logits[i], reqs[i])
        if banned:  # one indexed write for every row's banned tokens (per row, each would sync a GPU)
            ban_rows, ban_cols = zip(*banned)
            logits[_index(ban_rows, logits), _index(ban_cols, logits)] = float("-inf")
        if constrained:
            bitmask = self.structured.grammar_bitmask([reqs[i].structured_output_request for i in constrained])
            apply_grammar_bitmask(logits, bitmask, constrained)
        tokens = [0] * len(reqs)
        greedy = [i for i, r in enumerate(reqs) if r.sampling_params.greedy]
        if greedy:
            rows = logits if len(greedy) == len(reqs) else logits[greedy]
            for i, t in zip(greedy, rows.argmax(dim=-1).tolist()):
                tokens[i] = t
        random = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if random:
            filtered = filtered_logits(logits[random], [reqs[i] for i in random])
            for i, t in zip(random, draw_rows(filtered, [reqs[i].generator for i in random])):
                tokens[i] = t
        logprobs = [None] * len(reqs)
        for i, want in enumerate(want_logprobs):
            if want:
                logprobs[i] = _logprobs_entry(raw_logprobs[i], tokens[i], reqs[i].sampling_params.logprobs)
        return tokens, logprobs

    def _banned(self, req: Request) -> set[int]:
        """Tokens a request may not sample yet: its stop tokens (and EOS, unless ignored) until min_tokens."""
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            return set()
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)

    def _adjust(self, row: torch.Tensor, req: Request) -> None:
        """Penalties and logit bias, in place, as vLLM applies them (min_tokens masking: `_banned`)."""
        p = req.sampling_params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and req.num_output_tokens:
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)


def _index(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _adjusts(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty or p.presence_penalty or p.logit_bias)


def draw_rows(logits: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """One token from each row of (filtered) logits, row r drawing from generators[r]. Gumbel-max:
    argmax(logits - log(-log u)), u ~ U[0, 1) per entry, picks token i with probability softmax(logits)_i
    (the same as argmax(p / q) with q ~ Exp(1), without a softmax). Each row takes one float32 uniform per
    vocabulary entry from its generator, so `skip_draws` can replay what earlier tokens took; uniforms
    cost a seventh of what torch's Exp(1) draws do on CPU. One argmax for all rows: a GPU syncs once."""
    u = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for row, generator in zip(u, generators):
        row.uniform_(generator=generator)
    gumbel = u.log_().neg_().log_().neg_()  # u = 0 gives -inf: never picked
    return gumbel.add_(logits).argmax(dim=-1).tolist()


def skip_draws(generator: torch.Generator, vocab_size: int, n: int) -> None:
    """Advance `generator` past `n` draws, as if it had sampled the tokens a request got elsewhere (its
    first token on a prefill worker, or its output before a migration): a seeded request then continues
    with the samples it would have drawn on one worker."""
    u = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(n):
        u.uniform_(generator=generator)


def filtered_logits(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Logits after temperature, min-p, top-k and top-p, as float32; filtered-out tokens are -inf."""
    params = [r.sampling_params for r in reqs]
    logits = logits.float()
    temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temp.unsqueeze(1)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
    if (min_p > 0).any():
        probs = torch.softmax(logits, dim=-1)
        keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    if (top_k < vocab).any() or (top_p < 1.0).any():
        logits = _top_k_top_p(logits, top_k.clamp(max=vocab), top_p)
    return logits


def filtered_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p; filtered-out tokens get probability 0."""
    return torch.softmax(filtered_logits(logits, reqs), dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the top token always stays.
    # Rows with top_p=1 keep everything: rounding can push their cumulative mass to 1 early.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs_entry(logprobs: torch.Tensor, token: int, num_top: int) -> dict:
    top = {}
    if num_top:
        values, ids = logprobs.topk(num_top)
        top = dict(zip(ids.tolist(), values.tolist()))
    return {"token_id": token, "logprob": float(logprobs[token]), "top_logprobs": top}
