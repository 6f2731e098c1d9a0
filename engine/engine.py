"""The offline engine: add requests, step the batch, read outputs. Workers drive the same step API."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.forking import Forking
from engine.model_loader import load_tokenizer, resolve_model_dir
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput
from engine.reasoning import ReasoningBudget, ReasoningMarkers, force_reasoning_end
from engine.request import Request, output_ids
from engine.sampler import Sampler, skip_draws
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import SpeculativeConfig
from engine.spec_decode.speculator import SpecState, Speculator, new_spec_state
from engine.step_costs import StepCosts
from engine.structured import StructuredOutputManager

logger = logging.getLogger(__name__)


class Engine(Forking):
    """Continuous-batching inference on one model: `add_request`, `step`, `abort`, or `generate` for a batch.

    A request with n > 1 (or beam search) yields outputs under `candidate_id(request_id, i)`, one per
    candidate; its prompt is computed once and the candidates fork from it (engine/forking.py)."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        config.apply_threads()
        model_dir = resolve_model_dir(config.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.runner = ModelRunner(config, model_dir)
        self.kv_cache = self.runner.kv_cache
        self.max_model_len = min(config.max_model_len or self.runner.max_position_embeddings,
                                 self.runner.max_position_embeddings)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.eos_token_ids = _eos_token_ids(self.runner.model, self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, self.runner.vocab_size, config.max_num_seqs)
        self.sampler = Sampler(self.eos_token_ids, self.structured)
        self.reasoning_markers = (None if config.reasoning_markers is None
                                  else ReasoningMarkers.from_tokenizer(self.tokenizer, *config.reasoning_markers))
        # Drafts and verifies for the requests that speculate; made with the first such request.
        self.speculator = None if config.speculative_config is None else Speculator(config.speculative_config, self)
        self.requests: dict[str, Request] = {}
        self.waiting_for_grammar: list[Request] = []  # constrained requests whose grammar still compiles
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0
        self.step_costs = StepCosts()  # measured on every step; workers report it, the router places with it
        self.borrowing = False  # the coming step runs on borrowed cores as well (set by the engine loop)
        self.borrow_cut = False  # this step gave its borrowed cores back midway (engine_loop.watch_lenders)
        # Called with each step's schedule before its forward runs (a prefill worker leasing blocks early).
        self.on_scheduled: Callable[[list[tuple[Request, int]]], None] | None = None

    # ---- request intake -------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids or not all(isinstance(t, int) and 0 <= t < self.runner.vocab_size for t in ids):
            raise InvalidRequestError("prompt token ids must be a non-empty list of ids in the vocabulary",
                                      field="prompt")
        return ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                     cache_salt: str | None = None, output_token_ids: Sequence[int] = ()) -> Request:
        """Validate and build a request without queueing it (workers use this for their own bookkeeping).

        `output_token_ids` are tokens the request already generated elsewhere (a migrated request): they
        are prefilled with the prompt, count toward max_tokens and are not streamed again. A structured
        output's grammar starts compiling here, on the manager's thread; `add` holds the request back
        until it is ready."""
        params.validate(self.runner.vocab_size)
        if (params.n > 1 or params.use_beam_search) and output_token_ids:
            raise InvalidRequestError("a migrated request is one candidate; send it with n=1", field="n")
        if params.n > 1 and (params.structured is not None or params.max_reasoning_tokens is not None):
            raise InvalidRequestError("forked candidates carry no grammar or reasoning budget of their own yet: "
                                      "send n requests of one candidate (the ingress does)", field="n")
        prompt_ids = self.tokenize(prompt)
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens; the context window is "
                                      f"{self.max_model_len}, leaving no room to generate", field="prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(f"max_tokens={params.max_tokens} does not fit: prompt has {len(prompt_ids)} "
                                      f"tokens and the context window is {self.max_model_len}", field="max_tokens")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if self.block_manager.blocks_needed(len(prompt_ids) + max_tokens) > self.block_manager.num_blocks:
            raise InvalidRequestError(f"prompt + max_tokens needs more KV blocks than this worker has "
                                      f"({self.block_manager.num_blocks} x {self.config.block_size} tokens)",
                                      field="max_tokens")
        self._check_reasoning(params)
        if output_token_ids:
            vocab = self.runner.vocab_size
            if len(output_token_ids) >= max_tokens or not all(0 <= t < vocab for t in output_token_ids):
                raise InvalidRequestError(f"output_token_ids must be fewer than max_tokens={max_tokens} token ids "
                                          f"below {vocab}", field="output_token_ids")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seeds))
        if params.use_beam_search:
            return self.beam_search_request(request_id, prompt_ids, params, max_tokens, cache_salt)
        if params.n > 1:
            return self.candidate_requests(request_id, prompt_ids, params, max_tokens, cache_salt, seed)
        structured = None if params.structured is None else self.structured.request(params.structured)
        return Request(request_id, prompt_ids, params, max_tokens, cache_salt, self.generator(params, seed),
                       all_token_ids=[*prompt_ids, *output_token_ids], structured_output_request=structured,
                       spec=self._spec_state(params))

    def _spec_state(self, params: SamplingParams) -> SpecState | None:
        """A one-candidate request speculates when it asks to, or when the engine's config does by default
        and it does not opt out; requests with a reasoning budget do not (their logits are forced)."""
        config = self.config.speculative_config
        wanted = params.speculative if params.speculative is not None else config is not None and config.enabled_by_default
        if not wanted or params.max_reasoning_tokens is not None:
            return None
        return new_spec_state(config or SpeculativeConfig())

    def _check_reasoning(self, params: SamplingParams) -> None:
        if params.max_reasoning_tokens is None:
            return
        if self.reasoning_markers is None:
            raise InvalidRequestError("max_reasoning_tokens needs a model that thinks between markers; this "
                                      "engine has no reasoning_markers configured", field="max_reasoning_tokens")
        if params.structured is not None:
            raise InvalidRequestError("max_reasoning_tokens cannot be combined with structured outputs",
                                      field="max_reasoning_tokens")

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> Request:
        """Queue a request; raises InvalidRequestError (naming the field) when it cannot run."""
        req = self.make_request(request_id, prompt, params or SamplingParams(), cache_salt)
        if any(rid in self.requests for rid in output_ids(req)):
            raise InvalidRequestError(f"request id {request_id!r} is already running", field="request_id")
        self.add(req)
        return req

    def add(self, req: Request) -> None:
        """Queue an already built request. Output tokens it already has (sampled by a prefill worker, or
        before a migration) count as streamed: their text is not handed out again, and its generator
        skips the draws they took, and its grammar replays them once compiled. Candidates waiting to fork
        from `req` are registered with it."""
        self.num_prompt_tokens += req.num_prompt_tokens
        if req.spec is not None and self.speculator is None:  # the first request to opt in
            self.speculator = Speculator(SpeculativeConfig(enabled_by_default=False), self)
        if req.beam_search is not None:  # a search answers under its output ids once it ends
            self.scheduler.add(req)
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
                skip_draws(cand.generator, self.runner.vocab_size, cand.num_output_tokens)
            self.detokenizers[cand.request_id] = detok
        if req.sampling_params.max_reasoning_tokens is not None:
            req.reasoning = ReasoningBudget.replay(self.reasoning_markers, req.sampling_params.max_reasoning_tokens,
                                                   req.prompt_token_ids, req.output_token_ids)
        if req.structured_output_request is not None:  # one candidate only (SamplingParams.validate)
            self.waiting_for_grammar.append(req)
            return
        self.scheduler.add(req)
        if req.pending_forks and req.num_output_tokens:  # its first token was sampled elsewhere
            if req.num_computed_tokens:  # and its prompt KV is here: share it
                self.fork_imported(req)
            else:  # a fallback to local prefill: the candidates go on their own
                for cand in req.pending_forks:
                    self.scheduler.add(cand)
                req.pending_forks = []

    def _admit_structured(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is compiled, after replaying the tokens they already have
        into it; fail those whose grammar did not compile or does not allow those tokens."""
        failed = []
        for req in [r for r in self.waiting_for_grammar if r.structured_output_request.ready]:
            self.waiting_for_grammar.remove(req)
            try:
                if not req.structured_output_request.accept_tokens(req.output_token_ids):
                    raise InvalidRequestError("output_token_ids do not follow the request's structured output",
                                              field="output_token_ids")
            except InvalidRequestError as exc:
                failed.extend(self._fail(req, exc))
                continue
            self.scheduler.add(req)
        return failed

    def stats(self) -> dict:
        """Load and cache counters for the worker around this engine."""
        bm, sched = self.block_manager, self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        queued += sum(r.num_prompt_tokens - r.num_computed_tokens for r in sched.running
                      if r.num_computed_tokens < r.num_prompt_tokens)
        return {"num_waiting": len(sched.waiting) + len(self.waiting_for_grammar), "num_running": len(sched.running),
                "queued_prefill_tokens": queued, "num_active_blocks": bm.num_blocks - bm.num_free_blocks,
                "num_total_blocks": bm.num_blocks, "prefix_cache_queries": bm.prefix_cache_queries,
                "prefix_cache_hits": bm.prefix_cache_hits, "num_preemptions": sched.num_preemptions,
                "prompt_tokens": self.num_prompt_tokens, "generation_tokens": self.num_generation_tokens,
                "step_costs": self.step_costs.copy(), "kv_bytes_per_token": self.kv_cache.layout.bytes_per_token,
                "spec_decode": None if self.speculator is None else self.speculator.stats.copy()}

    def reserve_for_import(self, req: Request) -> list[int] | None:
        """Give `req` blocks for its whole prompt, reusing locally cached prefix blocks.

        Returns the indices (into `req.block_table`) of the blocks whose KV must be imported, or None when
        the pool is short. The caller writes them, then calls `add_imported` (or `release_import`).

        The whole prompt's KV comes with the import, so every full prompt block may be reused, whether or
        not the first token sampled elsewhere is already in `req` (decode may reserve before it exists)."""
        num_prompt = req.num_prompt_tokens
        computed = self.block_manager.get_computed_blocks(req, num_prompt + 1)
        num_cached = len(computed) * self.config.block_size
        if not self.block_manager.allocate_slots(req, num_prompt - num_cached, computed):
            return None
        req.num_cached_tokens = num_cached
        return list(range(len(computed), self.block_manager.blocks_needed(num_prompt)))

    def add_imported(self, req: Request) -> None:
        """Queue a request whose prompt KV now sits in its blocks; tokens it already produced elsewhere
        (the first one, sampled by the prefill worker) count as already streamed."""
        req.num_computed_tokens = req.num_prompt_tokens
        self.block_manager.cache_full_blocks(req)
        self.add(req)

    def release_import(self, req: Request) -> None:
        """Give back the blocks reserved for an import that did not happen."""
        self.block_manager.free(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when it is unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.beam_search is not None:
            self.finish_beams(req.beam_search, "abort")
            return True
        self.detokenizers.pop(request_id, None)
        if req in self.waiting_for_grammar:
            self.waiting_for_grammar.remove(req)
        req.finish_reason = "abort"
        if req.pending_forks:
            self.abort_pending_parent(req)
        self.scheduler.finish(req)
        return True

    def warm_up(self, num_prompt_tokens: int = 256, num_decode_steps: int = 4) -> None:
        """Measure the step costs before serving: decode steps of one sequence, then a prompt's prefill
        (each after an unmeasured first run that pays for one-time setup). The request never enters the
        scheduler, the prefix cache or the counters, and its blocks go back to the pool."""
        bm = self.block_manager
        n = min(num_prompt_tokens, self.max_model_len - num_decode_steps - 1,
                (bm.num_free_blocks - 1) * self.config.block_size - num_decode_steps - 1)
        if n < 1 or self.scheduler.has_unfinished():
            return
        ids = torch.randint(3, self.runner.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        req = Request("warm-up", ids, SamplingParams(temperature=0.0), num_decode_steps + 1)
        if not bm.allocate_slots(req, n + num_decode_steps + 1):
            return
        try:
            req.all_token_ids.append(int(self._forward([(req, n)], measure=False).argmax()))
            req.num_computed_tokens = n
            for i in range(num_decode_steps + 1):
                req.all_token_ids.append(int(self._forward([(req, 1)], measure=i > 0).argmax()))
                req.num_computed_tokens += 1
            req.num_computed_tokens = 0
            self._forward([(req, n)], measure=True)
        finally:
            bm.free(req)

    def _forward(self, scheduled: list[tuple[Request, int]], measure: bool) -> torch.Tensor:
        shape = step_shape(scheduled)
        started = time.perf_counter()
        logits = self.runner.execute(scheduled, [True] * len(scheduled))
        if measure:
            self.step_costs.observe(*shape, time.perf_counter() - started)
        return logits

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.waiting_for_grammar)

    # ---- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return what changed for each request."""
        failed = self._admit_structured() if self.waiting_for_grammar else []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        self.scheduler.step_token_cap = self._borrowed_step_cap() if self.borrowing else None
        self.borrow_cut = False
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.waiting_for_grammar and not failed:  # nothing to run until a grammar is ready
                self.structured.wait_any([r.structured_output_request for r in self.waiting_for_grammar], 0.01)
            return failed
        if self.on_scheduled is not None:
            self.on_scheduled(scheduled)
        sample_mask = [req.num_computed_tokens + n == req.num_tokens + len(req.spec_token_ids) for req, n in scheduled]
        num_logits = None if self.speculator is None else self.speculator.num_logits(scheduled)
        started = time.perf_counter()
        try:
            self.kv_cache.copy_blocks(self.block_manager.take_copies())
            logits = self.runner.execute(scheduled, sample_mask, num_logits)
        except Exception as exc:  # a failed forward fails its requests, not the engine
            logger.exception("model forward failed")
            return failed + [out for req, _ in scheduled for out in self._fail(req, exc)]
        sampled = [req for (req, _), s in zip(scheduled, sample_mask) if s]
        shape = step_shape(scheduled)  # before the requests advance
        prefilling = [req for req, n in scheduled
                      if req.num_computed_tokens == 0 or (n > 1 and not req.spec_token_ids)] if shape[1] else []
        for req, n in scheduled:
            if not req.spec_token_ids:  # a drafted request advances by what its verification keeps
                req.num_computed_tokens += n
                self.block_manager.cache_full_blocks(req)
        if self.speculator is None:
            outputs = self._sample(sampled, force_reasoning_end(logits, sampled))
        else:
            outputs = self.speculator.sample(sampled, logits)
        seconds = time.perf_counter() - started
        if self.borrow_cut:  # partly on borrowed cores: neither speed's measurement
            pass
        elif num_logits is None:
            self.step_costs.observe(*shape, seconds, borrowed=self.borrowing)
        else:
            self.speculator.observe_step(shape, num_logits, seconds)
        for req in prefilling:
            req.times.prefill_steps += 1
            req.times.prefill_borrowed_steps += self.borrowing or self.borrow_cut
            req.times.prefill_forward_s += seconds
        return failed + outputs

    def _borrowed_step_cap(self) -> int | None:
        """Prompt tokens a forward on borrowed cores may carry: what the borrowed speed computes within
        `borrow_slice_ms` (at least a block), so a lender that turns busy waits at most about that long
        for its core to be its own again."""
        slice_ms = self.config.borrow_slice_ms
        if not slice_ms:
            return None
        return self.step_costs.prefill_budget(0, slice_ms / 1000, self.config.block_size, borrowing=True)

    def _sample(self, sampled: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
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
            outputs += [self._append_token(req, t, lp) for req, t, lp in zip(reqs, tokens, logprobs)]
        return outputs

    def _append_token(self, req: Request, token: int, logprobs: dict | None) -> RequestOutput:
        now = time.time()
        req.times.first_token = req.times.first_token or now
        req.times.last_token = now
        req.all_token_ids.append(token)
        if req.reasoning is not None:
            req.reasoning.advance(token)
        self.num_generation_tokens += 1
        if req.structured_output_request is not None and not req.structured_output_request.accept_tokens([token]):
            return self._fail(req, RuntimeError(f"token {token} was sampled against the request's grammar"))[0]
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        detok = self.detokenizers[req.request_id]
        stop_string = detok.append(token)
        self._check_finish(req, token, stop_string)
        kv_transfer_params = None
        if req.finish_reason is not None or req.do_remote_decode:
            req.times.finished = now
            keep_blocks = req.do_remote_decode and req.finish_reason is None
            if keep_blocks:
                kv_transfer_params = {"block_ids": list(req.block_table), "num_tokens": req.num_prompt_tokens}
            self.scheduler.finish(req, free_blocks=not keep_blocks)
            self.requests.pop(req.request_id, None)
            self.detokenizers.pop(req.request_id, None)
        finished = req.finish_reason is not None
        return RequestOutput(req.request_id, [token], detok.take_new_text(finished), finished, req.finish_reason,
                             req.stop_reason,
                             [logprobs] if logprobs is not None else [], req.num_prompt_tokens,
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
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"

    def _fail(self, req: Request, exc: Exception) -> list[RequestOutput]:
        """Fail `req` and the candidates waiting to fork from it; a beam fails its whole search."""
        error = f"{type(exc).__name__}: {exc}"
        if req.beam_search is not None:
            ids = output_ids(req)
            self.finish_beams(req.beam_search, "error")
            return [RequestOutput(rid, [], "", True, "error", index=i, error=error) for i, rid in enumerate(ids)]
        outputs = []
        for cand in (req, *req.pending_forks):
            self.requests.pop(cand.request_id, None)
            self.detokenizers.pop(cand.request_id, None)
            cand.finish_reason = "error"
            self.scheduler.finish(cand)
            outputs.append(RequestOutput(cand.request_id, [], "", True, "error", index=cand.index, error=error))
        req.pending_forks = []
        return outputs

    # ---- offline batch --------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run prompts to completion as one continuous batch; one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params",
                                      field="sampling_params")
        ids, reqs = [], []
        for prompt, p in zip(prompts, params_list):
            reqs.append(self.make_request(f"gen-{next(self._ids)}", prompt, p))
            ids.append(output_ids(reqs[-1]))
        for req in reqs:  # only once every prompt is valid, so a bad one leaves nothing queued
            self.add(req)
        done: dict[str, CompletionOutput] = {}
        so_far: dict[str, RequestOutput] = {}  # each request's outputs added up
        while self.has_unfinished_requests():
            for out in self.step():
                whole = so_far.setdefault(out.request_id, out)
                if whole is not out:
                    whole.extend(out)
                if whole.finished:
                    done[out.request_id] = CompletionOutput(
                        out.request_id, whole.new_token_ids, "" if out.error else whole.new_text, out.finish_reason,
                        out.stop_reason, whole.new_logprobs, out.num_prompt_tokens, out.num_cached_tokens,
                        out.cumulative_logprob)
        results = []
        for group in ids:
            first = done[group[0]]
            first.candidates = [done[r] for r in group if r in done]  # a search may end with fewer than n
            results.append(first)
        return results


def step_shape(scheduled: list[tuple[Request, int]]) -> tuple[int, int, int]:
    """(decode tokens, prefill tokens, the longest context a prefill chunk ends at) of a schedule."""
    decodes = prefill = context = 0
    for req, n in scheduled:
        if n == 1 and req.num_computed_tokens > 0:
            decodes += 1
        else:
            prefill += n
            context = max(context, req.num_computed_tokens + n)
    return decodes, prefill, context


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids
