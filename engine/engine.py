"""The offline engine: add requests, step the batch, read outputs. Workers drive the same step API.

A step is schedule → run → sample → postprocess. Requests come in through the InputProcessor (validation,
tokenization), tokens go out through the OutputProcessor (finish checks, detokenization, failures); Forking
samples the rows (n candidates, beams) and the Speculator drafts and verifies."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from engine import cpu_kernels
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, RankFailed
from engine.forking import Forking
from engine.grammar_wait import GrammarWaitList
from engine.input_processor import InputProcessor, prompt_batch
from engine.lora_request import LoRARequest
from engine.model_loader import eos_token_ids, load_tokenizer, resolve_model_dir
from engine.model_runner import ModelRunner
from engine.output_processor import CompletionCollector, OutputProcessor
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel.ranks import start_ranks
from engine.reasoning import ReasoningMarkers, force_reasoning_end
from engine.request import Request, output_ids
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import CPU_PREFILL_BATCH_TOKENS, Scheduler
from engine.spec_decode import SpeculativeConfig
from engine.spec_decode.speculator import Speculator
from engine.step_context import OWN_CORES, StepBatch, StepContext
from engine.step_costs import StepCosts, stall_free_budget, step_shape
from engine.structured import StructuredOutputManager
from engine.timeline import RequestTimeline
from engine.warm_up import warm_up

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching inference on one model: `add_request`, `step`, `abort`, or `generate` for a batch.

    A request with n > 1 (or beam search) yields outputs under `candidate_id(request_id, i)`, one per
    candidate; its prompt is computed once and the candidates fork from it (engine/forking.py)."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        config.apply_threads()
        model_dir = resolve_model_dir(config.model)
        self.tokenizer = tokenizer = load_tokenizer(model_dir)
        self.ranks = None  # a tensor-parallel engine's other ranks (engine/parallel/ranks.py)
        if config.tensor_parallel_size > 1:
            self.ranks = start_ranks(config, model_dir)
        try:
            self.runner = runner = ModelRunner(config, model_dir, tp=self.ranks and self.ranks.group)
        except BaseException:
            self.close()
            raise
        self.kv_cache = runner.kv_cache
        self.max_model_len = min(config.max_model_len or runner.max_position_embeddings, runner.max_position_embeddings)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        if config.kv_tiers is not None and config.kv_tiers.enabled:
            self.block_manager.tiers = self._tiers(config)
        self.step_costs = StepCosts()  # measured on every step; workers report it, the router places with it
        self.scheduler = Scheduler(config, self.block_manager, self._prefill_budget(config),
                                   self._prefill_batch_tokens(config, runner.device.type))
        self.scheduler.loras = runner.lora
        self.eos_token_ids = eos_token_ids(runner.model, tokenizer)
        self.structured = StructuredOutputManager(tokenizer, runner.vocab_size, config.max_num_seqs)
        self.sampler = Sampler(self.eos_token_ids, self.structured)
        self.reasoning_markers = (None if config.reasoning_markers is None
                                  else ReasoningMarkers.from_tokenizer(tokenizer, *config.reasoning_markers))
        self.inputs = InputProcessor(config, tokenizer, runner.vocab_size, self.max_model_len, runner.device,
                                     self.block_manager, self.structured, self.eos_token_ids, self.reasoning_markers)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len, runner.vocab_size,
                                       self.reasoning_markers, self.scheduler)
        self.forking = Forking(self.scheduler, self.block_manager, self.sampler, self.outputs)
        # Drafts and verifies for the requests that speculate; made with the first such request.
        self.speculator = None if config.speculative_config is None else self.new_speculator(config.speculative_config)
        self.waiting_for_grammar = GrammarWaitList(self.structured)
        self.num_prompt_tokens = 0
        self._ids = itertools.count()

    def _tiers(self, config: EngineConfig):
        """The KV tiers below this engine's cache; not for a CUDA tensor-parallel cache (each rank's is its own)."""
        from engine.kv_tiers import KVTiers
        if config.tensor_parallel_size > 1 and self.runner.device.type != "cpu":
            self.close()
            raise ValueError("kv_tiers with tensor_parallel_size > 1 run on CPU only for now (a rank-local CUDA cache)")
        try:
            return KVTiers(config.kv_tiers, self.kv_cache, self.block_manager.events)
        except BaseException:
            self.close()
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop a tensor-parallel engine's other ranks (an engine of one rank holds nothing to stop): told to,
        or killed when a step may still be running on another thread (not `graceful`); and the tiers' copier."""
        if getattr(self, "block_manager", None) is not None and self.block_manager.tiers is not None:
            self.block_manager.tiers.close()
            self.block_manager.tiers = None
        if self.ranks is not None:
            self.ranks.close(graceful)
            self.ranks = None

    @property
    def requests(self) -> dict[str, Request]:
        """The live requests by output id."""
        return self.outputs.requests

    @property
    def num_generation_tokens(self) -> int:
        return self.outputs.num_generation_tokens

    def _prefill_budget(self, config: EngineConfig):
        """With an ITL SLO (a decode worker's), local prefills go in chunks that keep each step within it."""
        if not config.itl_slo_ms:
            return None
        return stall_free_budget(self.step_costs, config.itl_slo_ms / 1000, config.stall_ratio)

    @staticmethod
    def _prefill_batch_tokens(config: EngineConfig, device_type: str) -> int | None:
        if config.prefill_batch_tokens is None:
            return CPU_PREFILL_BATCH_TOKENS if device_type == "cpu" else None
        return config.prefill_batch_tokens or None

    def new_speculator(self, config: SpeculativeConfig) -> Speculator:
        """A speculator on this engine's model, sampler and outputs (bench/spec_decode.py compares two)."""
        return Speculator(config, self.config, self.block_manager, self.step_costs, self.sampler, self.forking.sample,
                          self.outputs.append_token)

    # ---- request intake -------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return self.inputs.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.inputs.apply_chat_template(messages)

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                     cache_salt: str | None = None, output_token_ids: Sequence[int] = (),
                     timeline: RequestTimeline | None = None, priority: float = 0,
                     lora: LoRARequest | None = None) -> Request:
        """Validate and build a request without queueing it (InputProcessor.make_request). A worker passes
        the output tokens a migrated request already streamed, and its request's timeline for the engine
        to stamp (a new one otherwise). `priority`: lower is scheduled first and preempted last. `lora`: the
        adapter it runs with, read now (InvalidRequestError naming `model` when it cannot be served)."""
        if lora is not None:
            self.prepare_lora(lora)
        req = self.inputs.make_request(request_id, prompt, params, cache_salt, output_token_ids, timeline)
        for r in (req, *req.pending_forks):
            r.priority = priority
            r.lora = lora
        return req

    def unload_lora(self, name: str) -> bool:
        """Forget adapter `name` (LoRAManager.unload); False when it was not held or LoRA is off."""
        return self.runner.lora is not None and self.runner.lora.unload(name)

    def prepare_lora(self, lora: LoRARequest) -> None:
        """Read adapter `lora` into host memory and check it fits this model (InvalidRequestError otherwise)."""
        from engine.lora import LoRAError
        if self.runner.lora is None:
            raise InvalidRequestError(f"model {lora.name!r} is a LoRA adapter, and this engine runs without "
                                      f"enable_lora", field="model")
        try:
            self.runner.lora.prepare(lora)
        except LoRAError as e:
            raise InvalidRequestError(str(e), field="model") from None

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, priority: int = 0, lora: LoRARequest | None = None) -> Request:
        """Queue a request; raises InvalidRequestError (naming the field) when it cannot run."""
        req = self.make_request(request_id, prompt, params or SamplingParams(), cache_salt, priority=priority,
                                lora=lora)
        if any(rid in self.requests for rid in output_ids(req)):
            raise InvalidRequestError(f"request id {request_id!r} is already running", field="request_id")
        self.add(req)
        return req

    def add(self, req: Request) -> None:
        """Queue an already built request. Output tokens it already has (sampled by a prefill worker, or
        before a migration) count as streamed (OutputProcessor.add), and its grammar replays them once
        compiled. Candidates waiting to fork from `req` are registered with it."""
        self.num_prompt_tokens += req.num_prompt_tokens
        if req.spec is not None and self.speculator is None:  # the first request to opt in
            self.speculator = self.new_speculator(SpeculativeConfig(enabled_by_default=False))
        self.outputs.add(req)
        if req.structured_output_request is not None:  # one candidate only (SamplingParams.validate)
            self.waiting_for_grammar.add(req)
            return
        self.scheduler.add(req)
        if not req.num_computed_tokens:
            self.block_manager.promote(req, remote=True)  # its prefix's blocks below come back ahead of its step
        if req.pending_forks and req.num_output_tokens:  # its first token was sampled elsewhere
            self.forking.add_first_sampled(req)

    def _admit_structured(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is ready; fail those it does not accept."""
        ready, failed = self.waiting_for_grammar.take_ready()
        for req in ready:
            self.scheduler.add(req)
        return [self.outputs.fail(req, exc) for req, exc in failed]

    def stats(self) -> dict:
        """Load and cache counters for the worker around this engine."""
        bm, sched = self.block_manager, self.scheduler
        # A waiting prompt will compute only what its prefix hit leaves: counted whole, a queue of hits on a
        # 1,536-token prefix read as 1,600 tokens each, and the router predicted the queue 3 s deep per hit
        # where each took 0.2 s (requests sharing a prefix waited at the ingress or went to a busy decode worker).
        queued = sum(r.num_tokens - (r.num_computed_tokens or len(bm.peek_computed_blocks(r)) * bm.block_size)
                     for r in sched.waiting)
        queued += sum(r.num_prompt_tokens - r.num_computed_tokens for r in sched.running
                      if r.num_computed_tokens < r.num_prompt_tokens)
        return {"num_waiting": len(sched.waiting) + len(self.waiting_for_grammar), "num_running": len(sched.running),
                "queued_prefill_tokens": queued, "num_active_blocks": bm.num_blocks - bm.num_free_blocks,
                "num_total_blocks": bm.num_blocks, "prefix_cache_queries": bm.prefix_cache_queries,
                "prefix_cache_hits": bm.prefix_cache_hits, "num_preemptions": sched.num_preemptions,
                "prefill_yield_chunks": sched.yield_chunks,
                "prompt_tokens": self.num_prompt_tokens, "generation_tokens": self.num_generation_tokens,
                "step_costs": self.step_costs.copy(), "kv_bytes_per_token": self.kv_cache.layout.bytes_per_token,
                "spec_decode": None if self.speculator is None else self.speculator.stats.copy(),
                "cpu_kernel_fallbacks": len(cpu_kernels.failed_kernels()) if self.runner.device.type == "cpu" else 0,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "tp_ranks_alive": 1 if self.ranks is None else 1 + self.ranks.num_alive(),
                "tp_shm_too_large": 0 if self.ranks is None or self.ranks.group.shm is None
                else self.ranks.group.shm.too_large,
                "kv_tiers": None if bm.tiers is None else bm.tiers.stats(),
                "lora": None if self.runner.lora is None else self.runner.lora.summary(sched.running, sched.waiting)}

    def reserve_for_import(self, req: Request) -> list[int] | None:
        """Blocks for `req`'s whole prompt (BlockManager.reserve_for_import): the indices of those whose KV must
        be imported, or None when the pool is short. The caller writes them, then calls `add_imported` (or
        `release_import`)."""
        return self.block_manager.reserve_for_import(req)

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
        req = self.outputs.pop(request_id)
        if req is None:
            return False
        self.waiting_for_grammar.discard(req)
        self.forking.abort(req)
        return True

    def warm_up(self, num_prompt_tokens: int = 256, num_decode_steps: int = 4) -> None:
        """Measure the step costs before serving (engine/warm_up.py); only while no request is queued."""
        if not self.scheduler.has_unfinished():
            warm_up(self.runner, self.block_manager, self.step_costs, self.max_model_len, num_prompt_tokens,
                    num_decode_steps)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.waiting_for_grammar)

    def has_prompt_work(self) -> bool:
        """Whether some request still has prompt tokens to compute here (not only decodes)."""
        return self.scheduler.has_prompt_work() or bool(self.waiting_for_grammar)

    # ---- the loop -------------------------------------------------------------------------------

    def step(self, context: StepContext = OWN_CORES) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return what changed for each request. `context` says
        whether the forward runs on borrowed cores as well, and who watches what it schedules (the engine
        loop's; read, never written)."""
        failed = self._admit_structured() if self.waiting_for_grammar else []
        scheduled = self._schedule(context)
        while self.scheduler.lora_failed:  # its adapter could not be read back into a slot
            failed += self.forking.fail(*self.scheduler.lora_failed.pop())
        if not scheduled:
            return self._idle(failed)
        try:
            batch = self._run(scheduled)
        except RankFailed:  # the engine itself is broken: its requests are for a restarted worker to resume
            raise
        except Exception as exc:  # a failed forward fails its requests, not the engine
            logger.exception("model forward failed")
            return failed + [out for req, _ in scheduled for out in self.forking.fail(req, exc)]
        outputs = self._sample(batch)
        self._postprocess(batch, context)
        return failed + outputs

    def _schedule(self, context: StepContext) -> list[tuple[Request, int]]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        cap = yield_cap = None
        if context.borrowing:
            cap = self.step_costs.borrowed_step_cap(self.config.borrow_slice_ms, self.config.block_size)
        if self.config.yield_slice_ms and (above := self.scheduler.yields()) is not None:
            yield_cap = above, self.step_costs.prefill_budget(0, self.config.yield_slice_ms / 1000, self.config.block_size,
                                                              borrowing=context.borrowing)
        scheduled = self.scheduler.schedule(cap, yield_cap)
        if scheduled and context.on_scheduled is not None:
            context.on_scheduled(scheduled)
        return scheduled

    def _idle(self, failed: list[RequestOutput]) -> list[RequestOutput]:
        if self.waiting_for_grammar and not failed:  # nothing to run until a grammar is ready
            self.waiting_for_grammar.wait(0.01)
        return failed

    def _run(self, scheduled: list[tuple[Request, int]]) -> StepBatch:
        sample_mask = [req.num_computed_tokens + n == req.num_tokens + len(req.spec_token_ids) for req, n in scheduled]
        num_logits = None if self.speculator is None else self.speculator.num_logits(scheduled)
        started = time.perf_counter()
        self.runner.copy_blocks(self.block_manager.take_copies())
        logits = self.runner.execute(scheduled, sample_mask, num_logits)
        shape = step_shape(scheduled)
        prefilling = [req for req, n in scheduled
                      if req.num_computed_tokens == 0 or (n > 1 and not req.spec_token_ids)] if shape[1] else []
        sampled = [req for (req, _), s in zip(scheduled, sample_mask) if s]
        return StepBatch(scheduled, sampled, logits, num_logits, shape, prefilling, started)

    def _sample(self, batch: StepBatch) -> list[RequestOutput]:
        """Advance each request past the tokens the forward computed (a drafted request advances by what
        its verification keeps), then sample the rows."""
        window = self.runner.release_window
        for req, n in batch.scheduled:
            if not req.spec_token_ids:
                req.num_computed_tokens += n
                self.block_manager.cache_full_blocks(req)
            if window is not None and not req.do_remote_decode:  # a prompt leased to decode keeps every block
                self.block_manager.release_outside_window(req, window)
        if self.speculator is not None:
            return self.speculator.sample(batch.sampled, batch.logits)
        return self.forking.sample(batch.sampled, force_reasoning_end(batch.logits, batch.sampled))

    def _postprocess(self, batch: StepBatch, context: StepContext) -> None:
        """Measure the step (one partly on borrowed cores is neither speed's) and count it to its prompts."""
        seconds = time.perf_counter() - batch.started
        if context.borrow_cut:
            pass
        elif batch.num_logits is None:
            self.step_costs.observe(*batch.shape, seconds, borrowed=context.borrowing)
        else:
            self.speculator.observe_step(batch.shape, batch.num_logits, seconds)
        borrowed = context.borrowing or context.borrow_cut
        for req in batch.prefilling:
            req.timeline.count_prefill_step(seconds, borrowed)

    # ---- offline batch --------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run prompts to completion as one continuous batch; one output per prompt, in order."""
        reqs = [self.make_request(f"gen-{next(self._ids)}", prompt, p)
                for prompt, p in prompt_batch(prompts, sampling_params)]
        for req in reqs:  # only once every prompt is valid, so a bad one leaves nothing queued
            self.add(req)
        completions = CompletionCollector([output_ids(req) for req in reqs])
        while self.has_unfinished_requests():
            completions.add(self.step())
        return completions.results()

