"""n candidates and beams of one prompt as forked requests: the prompt is computed once, its blocks are
shared by reference count, and a fork copies a shared block only when it writes into it.

`Forking.sample` is the step's sampling stage: candidates fork from the row of the request they wait on,
beams go to their search. It runs on the engine's thread like the rest of the step."""
from __future__ import annotations

import torch

from engine.beam_search import BeamSearch
from engine.block_manager import BlockManager
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import Scheduler


class Forking:
    """Samples the step's rows and forks requests: n > 1 candidates after their prompt, beams every step."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, sampler: Sampler,
                 outputs: OutputProcessor):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.sampler = sampler
        self.outputs = outputs

    def sample(self, sampled: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample each request's next token; candidates forking from a request sample from its row with
        their own generators, and beams go to their search."""
        beam_rows = [i for i, req in enumerate(sampled) if req.beam_search is not None]
        outputs = self.advance_beams([sampled[i] for i in beam_rows], logits[beam_rows]) if beam_rows else []
        rows = [i for i, req in enumerate(sampled) if req.beam_search is None]
        reqs = [sampled[i] for i in rows]
        for i in list(rows):
            if sampled[i].pending_forks:
                children = self.fork_pending(sampled[i])
                reqs += children
                rows += [i] * len(children)
        if reqs:
            same_rows = rows == list(range(len(sampled)))
            tokens, logprobs = self.sampler(logits if same_rows else logits[rows], reqs)
            append_token = self.outputs.append_token
            outputs += [append_token(req, t, lp) for req, t, lp in zip(reqs, tokens, logprobs)]
        return outputs

    def fail(self, req: Request, exc: Exception) -> list[RequestOutput]:
        """Fail `req` and the candidates waiting to fork from it; a beam fails its whole search."""
        if req.beam_search is not None:
            return self.finish_beams(req.beam_search, error=exc)
        outputs = [self.outputs.fail(cand, exc) for cand in (req, *req.pending_forks)]
        req.pending_forks = []
        return outputs

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

    def add_first_sampled(self, parent: Request) -> None:
        """`parent`'s first token was sampled elsewhere: with its prompt KV here (an import) the candidates
        share it and recompute its last token, which gives each the logits for a first token of its own;
        without (a fallback to local prefill) they go on their own."""
        if not parent.num_computed_tokens:
            for cand in parent.pending_forks:
                self.scheduler.add(cand)
            parent.pending_forks = []
            return
        first = parent.all_token_ids.pop()
        children = self.fork_pending(parent)
        parent.all_token_ids.append(first)
        for child in children:
            child.num_computed_tokens -= 1

    def abort(self, req: Request) -> None:
        """Stop `req` and free its blocks; a beam aborts its whole search, and candidates still waiting to
        fork from `req` fork from the first live one of them instead, which takes over its prompt."""
        if req.beam_search is not None:
            self.finish_beams(req.beam_search, aborted=True)
            return
        req.finish_reason = "abort"
        req.pending_forks = [c for c in req.pending_forks if c.finish_reason is None]
        if req.pending_forks:
            heir = self.fork(req, req.pending_forks[0].take_pending(req))
            self.scheduler.replace(req, heir)
        self.scheduler.finish(req)

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
        self.outputs.append_beam_tokens(plan)
        if not search.beams or self.outputs.length_reached(search.beams[0]):
            return self.finish_beams(search)
        return []

    def _new_beam(self, search: BeamSearch, parent: Request) -> Request:
        return Request(search.next_beam_id(), parent.prompt_token_ids, parent.sampling_params, parent.max_tokens,
                       parent.cache_salt, beam_search=search, timeline=parent.timeline, lora=parent.lora)

    def finish_beams(self, search: BeamSearch, aborted: bool = False,
                     error: Exception | None = None) -> list[RequestOutput]:
        """End a search: free its beams and return its n best as finished outputs (none when aborted, an
        error under each output id when it failed)."""
        best = search.best() if not aborted and error is None else []
        for beam in search.beams:
            self.scheduler.finish(beam)
        search.beams, search.rows = [], {}
        return self.outputs.search_outputs(search, best, error)
