"""Beam search as vLLM runs it, with beams as forked requests sharing their KV blocks.

Each step every live beam offers its 2 x beam_width most likely next tokens (raw model log-probabilities,
no temperature); a continuation ending in EOS is completed, the beam_width best of the others go on. A
beam chosen k times is forked k - 1 times (Forking.fork: shared blocks, copy on write), a beam not chosen
is freed. After max_tokens steps, or once no beam is live, the n best of the completed and live beams
come back in score order: cumulative logprob / length ** length_penalty, where the length counts the
prompt and the output without a final EOS (vLLM's `get_beam_search_score`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.request import Request


@dataclass(slots=True)
class BeamSearchSequence:
    """A beam's output tokens, cumulative logprob and how it ended."""
    tokens: list[int]
    cum_logprob: float
    finish_reason: str


def get_beam_search_score(num_tokens: int, cum_logprob: float, ends_with_eos: bool,
                          length_penalty: float = 1.0) -> float:
    """vLLM's beam score: `num_tokens` (prompt + output) not counting a final EOS."""
    return cum_logprob / ((num_tokens - ends_with_eos) ** length_penalty)


@dataclass(slots=True, eq=False)
class BeamSearch:
    """One prompt's search: its live beams (requests), the log-probability rows they produced this step,
    and the completed sequences."""
    request_id: str
    num_prompt_tokens: int
    beam_width: int
    n: int
    length_penalty: float
    eos_token_ids: frozenset[int]
    beams: list[Request] = field(default_factory=list)
    rows: dict[Request, torch.Tensor] = field(default_factory=dict)
    completed: list[BeamSearchSequence] = field(default_factory=list)
    ids: itertools.count = field(default_factory=itertools.count)

    def next_beam_id(self) -> str:
        return f"{self.request_id}-beam-{next(self.ids)}"

    def offer(self, beam: Request, logprobs: torch.Tensor) -> bool:
        """Take one beam's log-probabilities for this step; True once every live beam has offered."""
        self.rows[beam] = logprobs
        return len(self.rows) == len(self.beams)

    def select(self) -> list[tuple[Request, int, float]]:
        """The next beams as (beam it extends, token, cumulative logprob), best first; EOS continuations
        go to `completed`."""
        beams, rows = self.beams, torch.stack([self.rows[b] for b in self.beams])
        self.rows = {}
        values, tokens = rows.topk(min(2 * self.beam_width, rows.shape[1]), dim=-1)
        ignore_eos = beams[0].sampling_params.ignore_eos
        candidates = []
        for beam, lps, toks in zip(beams, values.tolist(), tokens.tolist()):
            for lp, token in zip(lps, toks):
                cum = beam.cumulative_logprob + lp
                if token in self.eos_token_ids and not ignore_eos:
                    self.completed.append(BeamSearchSequence([*beam.output_token_ids, token], cum, "stop"))
                else:
                    candidates.append((beam, token, cum))
        candidates.sort(key=lambda c: c[2], reverse=True)  # one length for all: score order
        return candidates[:self.beam_width]

    def best(self) -> list[BeamSearchSequence]:
        """The n best of the completed and the live beams, best first."""
        final = self.completed + [BeamSearchSequence(b.output_token_ids, b.cumulative_logprob, "length")
                                  for b in self.beams]
        return sorted(final, key=self.score, reverse=True)[:self.n]

    def score(self, seq: BeamSearchSequence) -> float:
        return get_beam_search_score(self.num_prompt_tokens + len(seq.tokens), seq.cum_logprob,
                                     seq.finish_reason == "stop", self.length_penalty)
