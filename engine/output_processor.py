"""Output processing: sampled tokens become RequestOutputs (vLLM v1's OutputProcessor). Appends each token,
checks whether the request finished (EOS, stop ids, stop strings, length, a completed grammar), detokenizes
incrementally, and turns failures and finished beam searches into outputs."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.reasoning import ReasoningBudget, ReasoningMarkers
from engine.request import Request, output_ids
from engine.sampler import skip_draws
from engine.sampling_params import candidate_id

if TYPE_CHECKING:
    from engine.beam_search import BeamSearch, BeamSearchSequence
    from engine.scheduler import Scheduler


class OutputProcessor:
    """Owns the live requests by output id (`requests`) and their detokenizers; finished requests leave the
    scheduler here. Runs on the engine's thread."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, vocab_size: int,
                 reasoning_markers: ReasoningMarkers | None, scheduler: Scheduler):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.reasoning_markers = reasoning_markers
        self.scheduler = scheduler
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_generation_tokens = 0

    def add(self, req: Request) -> None:
        """Register `req` (and the candidates pending on it) under its output ids. Output tokens it already
        has count as streamed: their text is not handed out again, its generator skips the draws they
        took, and its reasoning budget replays them."""
        if req.beam_search is not None:  # a search answers under its output ids once it ends
            self.requests.update(dict.fromkeys(output_ids(req), req))
            return
        for cand in (req, *req.pending_forks):
            self.requests[cand.request_id] = cand
            detok = IncrementalDetokenizer(self.tokenizer, cand.prompt_token_ids, cand.sampling_params,
                                           self.eos_token_ids)
            for token in cand.output_token_ids:
                detok.append(token)
            detok.take_new_text(finished=False)
            if cand.generator is not None:
                skip_draws(cand.generator, self.vocab_size, cand.num_output_tokens)
            self.detokenizers[cand.request_id] = detok
        if req.sampling_params.max_reasoning_tokens is not None:
            req.reasoning = ReasoningBudget.replay(self.reasoning_markers, req.sampling_params.max_reasoning_tokens,
                                                   req.prompt_token_ids, req.output_token_ids)

    def pop(self, request_id: str) -> Request | None:
        """Forget a request (an abort): it produces no more outputs."""
        self.detokenizers.pop(request_id, None)
        return self.requests.pop(request_id, None)

    def append_token(self, req: Request, token: int, logprobs: dict | None) -> RequestOutput:
        """Append one sampled token to `req`; a finished request leaves the scheduler (a prefill worker's
        request keeps its blocks for decode to pull, named in `kv_transfer_params`)."""
        req.all_token_ids.append(token)
        if req.reasoning is not None:
            req.reasoning.advance(token)
        self.num_generation_tokens += 1
        if req.structured_output_request is not None and not req.structured_output_request.accept_tokens([token]):
            return self.fail(req, RuntimeError(f"token {token} was sampled against the request's grammar"))
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        detok = self.detokenizers[req.request_id]
        self._check_finish(req, token, detok.append(token))
        kv_transfer_params = None
        if req.finish_reason is not None or req.do_remote_decode:
            keep_blocks = req.do_remote_decode and req.finish_reason is None
            if keep_blocks:
                kv_transfer_params = {"block_ids": list(req.block_table), "num_tokens": req.num_prompt_tokens}
            self.scheduler.finish(req, free_blocks=not keep_blocks)
            self.requests.pop(req.request_id, None)
            self.detokenizers.pop(req.request_id, None)
        finished = req.finish_reason is not None
        return RequestOutput(req.request_id, [token], detok.take_new_text(finished), finished, req.finish_reason,
                             req.stop_reason, [logprobs] if logprobs is not None else [], req.num_prompt_tokens,
                             req.num_cached_tokens, kv_transfer_params=kv_transfer_params, index=req.index)

    def _check_finish(self, req: Request, token: int, stop_string: str | None) -> None:
        p = req.sampling_params
        if req.structured_output_request is not None and req.structured_output_request.is_terminated:
            req.finish_reason = "stop"  # the grammar allows nothing more (the output is complete)
            return
        if req.num_output_tokens >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                req.finish_reason = "stop"
                return
            if token in p.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", token
                return
            if stop_string is not None:
                req.finish_reason, req.stop_reason = "stop", stop_string
                return
        if self.length_reached(req):
            req.finish_reason = "length"

    def length_reached(self, req: Request) -> bool:
        """`req` has its max_tokens, or fills the context window."""
        return req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len

    def fail(self, req: Request, exc: Exception) -> RequestOutput:
        """Finish `req` with an error output (a beam search fails as a whole: Forking.fail)."""
        self.requests.pop(req.request_id, None)
        self.detokenizers.pop(req.request_id, None)
        req.finish_reason = "error"
        self.scheduler.finish(req)
        return RequestOutput(req.request_id, [], "", True, "error",
                             index=req.index, error=error_text(exc))

    def append_beam_tokens(self, plan: list[tuple[Request, int, float]]) -> None:
        """Extend each chosen beam by its token; its cumulative logprob is the continuation's."""
        for beam, token, cum in plan:
            beam.all_token_ids.append(token)
            beam.cumulative_logprob = cum
        self.num_generation_tokens += len(plan)

    def search_outputs(self, search: BeamSearch, best: list[BeamSearchSequence],
                       error: Exception | None = None) -> list[RequestOutput]:
        """The outputs of an ended search: its n best, or an error under each output id when it failed
        (none when it was aborted: no `best`, no `error`)."""
        ids = [candidate_id(search.request_id, i) for i in range(search.n)]
        root = self.requests.get(ids[0])
        for rid in ids:
            self.requests.pop(rid, None)
        if error is not None:
            return [RequestOutput(rid, [], "", True, "error", index=i, error=error_text(error))
                    for i, rid in enumerate(ids)]
        if root is None:
            return []
        skip = root.sampling_params.skip_special_tokens
        outputs = []
        for i, seq in enumerate(best):
            text = self.tokenizer.decode(seq.tokens, skip_special_tokens=skip)
            outputs.append(RequestOutput(ids[i], list(seq.tokens), text, True, seq.finish_reason, None, [],
                                         root.num_prompt_tokens, root.num_cached_tokens, index=i,
                                         cumulative_logprob=seq.cum_logprob))
        return outputs


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


class CompletionCollector:
    """Folds a batch's step outputs into one CompletionOutput per prompt, in order (Engine.generate);
    `groups` holds each prompt's output ids."""

    def __init__(self, groups: list[list[str]]):
        self.groups = groups
        self.done: dict[str, CompletionOutput] = {}
        self.so_far: dict[str, RequestOutput] = {}  # each request's outputs added up

    def add(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            whole = self.so_far.setdefault(out.request_id, out)
            if whole is not out:
                whole.extend(out)
            if whole.finished:
                del self.so_far[out.request_id]
                self.done[out.request_id] = CompletionOutput(
                    out.request_id, whole.new_token_ids, "" if out.error else whole.new_text, out.finish_reason,
                    out.stop_reason, whole.new_logprobs, out.num_prompt_tokens, out.num_cached_tokens,
                    out.cumulative_logprob)

    def results(self) -> list[CompletionOutput]:
        results = []
        for group in self.groups:
            first = self.done[group[0]]
            first.candidates = [self.done[r] for r in group if r in self.done]  # a search may end with fewer than n
            results.append(first)
        return results
