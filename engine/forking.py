"""n candidates and beams of one prompt as forked requests: the prompt is computed once, its blocks are
shared by reference count, and a fork copies a shared block only when it writes into it.

The Engine mixes this in; it runs on the engine's thread like the rest of the step."""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.beam_search import BeamSearch
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams, candidate_id, candidate_seed


class Forking:
    """Engine methods that fork requests: n > 1 candidates after their prompt, beams every step."""

    def candidate_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                           cache_salt: str | None, seed: int) -> Request:
        """The first of n candidates, the others pending on it; candidate i draws from candidate_seed(seed, i)."""
        candidates = []
        for i in range(params.n):
            p = replace(params, n=1, seed=candidate_seed(seed, i))
            candidates.append(Request(candidate_id(request_id, i), prompt_ids, p, max_tokens, cache_salt,
                                      self.generator(p, p.seed), index=i))
        candidates[0].pending_forks = candidates[1:]
        return candidates[0]

    def beam_search_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                            cache_salt: str | None) -> Request:
        """The first beam of a new search, which answers under `candidate_id(request_id, i)`."""
        search = BeamSearch(request_id, len(prompt_ids), params.beam_width, params.n, params.length_penalty,
                            frozenset(self.eos_token_ids))
        root = Request(search.next_beam_id(), prompt_ids, params, max_tokens, cache_salt, beam_search=search)
        search.beams = [root]
        return root

    def generator(self, params: SamplingParams, seed: int) -> torch.Generator | None:
        """The seeded generator a request samples from; None for greedy."""
        return None if params.greedy else torch.Generator(self.runner.device).manual_seed(seed)

    def fork(self, parent: Request, child: Request) -> Request:
        """Make `child` continue from `parent`'s tokens on `parent`'s blocks (shared, copy on write)."""
        child.take_state(parent)
        self.block_manager.fork(parent, child)
        return child

    def fork_pending(self, parent: Request) -> list[Request]:
        """Fork the candidates waiting for `parent`'s prompt (none aborted) and queue them."""
        children = [self.fork(parent, c) for c in parent.pending_forks if c.finish_reason is None]
        parent.pending_forks = []
        self.scheduler.add_forked(children)
        return children

    def fork_imported(self, parent: Request) -> None:
        """After a KV import: the candidates share the prompt's blocks and recompute its last token, which
        gives each the logits for a first token of its own (the parent's came from the prefill worker)."""
        first = parent.all_token_ids.pop()
        children = self.fork_pending(parent)
        parent.all_token_ids.append(first)
        for child in children:
            child.num_computed_tokens -= 1

    def abort_pending_parent(self, parent: Request) -> None:
        """`parent` is aborted before its candidates forked: the first live one takes over its prompt."""
        parent.pending_forks = [c for c in parent.pending_forks if c.finish_reason is None]
        if parent.pending_forks:
            heir = self.fork(parent, parent.pending_forks[0].take_pending(parent))
            self.scheduler.replace(parent, heir)

    # ---- beam search ----------------------------------------------------------------------------

    def advance_beams(self, beams: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        """Take this step's rows of the beams sampled; each search whose beams have all offered steps on."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        outputs = []
        for beam, row in zip(beams, logprobs):
            search: BeamSearch = beam.beam_search
            if search.offer(beam, row):
                outputs += self._step_beams(search)
        return outputs

    def _step_beams(self, search: BeamSearch) -> list[RequestOutput]:
        plan, forks = [], []
        for beam, token, cum in search.select():
            if any(target is beam for target, _, _ in plan):
                beam = self.fork(beam, self._new_beam(search, beam))
                forks.append(beam)
            plan.append((beam, token, cum))
        for beam in search.beams:
            if not any(target is beam for target, _, _ in plan):
                self.scheduler.finish(beam)  # pruned
        self.scheduler.add_forked(forks)
        search.beams = [target for target, _, _ in plan]
        for target, token, cum in plan:
            target.all_token_ids.append(token)
            target.cumulative_logprob = cum
        self.num_generation_tokens += len(plan)
        beam = search.beams[0] if search.beams else None
        if beam is None or beam.num_output_tokens >= beam.max_tokens or beam.num_tokens >= self.max_model_len:
            return self.finish_beams(search)
        return []

    def _new_beam(self, search: BeamSearch, parent: Request) -> Request:
        return Request(search.next_beam_id(), parent.prompt_token_ids, parent.sampling_params, parent.max_tokens,
                       parent.cache_salt, beam_search=search, times=parent.times)

    def finish_beams(self, search: BeamSearch, finish_reason: str | None = None) -> list[RequestOutput]:
        """End a search: free its beams and return its n best as finished outputs (none when aborted or
        failed, `finish_reason` given)."""
        best = search.best() if finish_reason is None else []
        for beam in search.beams:
            self.scheduler.finish(beam)
        search.beams, search.rows = [], {}
        ids = [candidate_id(search.request_id, i) for i in range(search.n)]
        root = self.requests.get(ids[0])
        for rid in ids:
            self.requests.pop(rid, None)
        if root is None or finish_reason is not None:
            return []
        skip = root.sampling_params.skip_special_tokens
        outputs = []
        for i, seq in enumerate(best):
            text = self.tokenizer.decode(seq.tokens, skip_special_tokens=skip)
            outputs.append(RequestOutput(ids[i], list(seq.tokens), text, True, seq.finish_reason, None, [],
                                         root.num_prompt_tokens, root.num_cached_tokens, index=i,
                                         cumulative_logprob=seq.cum_logprob))
        return outputs
