"""Continuous batching under a token budget, with chunked prefill and preemption by recompute."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import Request, RequestStatus

# EngineConfig.prefill_batch_tokens on CPU: up to this many prompt tokens of several prompts share a forward.
CPU_PREFILL_BATCH_TOKENS = 256


@dataclass(slots=True)
class StepBudget:
    """What is left of one step's token budget, and of its prefill room once its first prompt chunk set it."""
    tokens: int
    num_decodes: int  # the running decodes the prefill room is sized for (0 without a `prefill_budget`)
    prefill: int | None = None
    prompt_tokens: int = 0  # prompt chunk tokens taken so far
    yield_room: int | None = None  # prompt tokens left for the prompts that yield (Scheduler.yields); None: no cap

    def take(self, num_new: int, num_drafts: int = 0) -> None:
        self.tokens -= num_new + num_drafts
        if num_new > 1:
            self.prefill -= num_new
            self.prompt_tokens += num_new


class Scheduler:
    """Each step gives running requests their next tokens first (decode or the next prefill chunk),
    then admits waiting ones while the token budget, `max_num_seqs` and free blocks allow. When a
    running request cannot get a block, the most recently admitted one is preempted and recomputed later.

    `prefill_budget`, when set (a decode worker sets it from its ITL SLO), caps the prompt tokens of a
    step that also runs decodes: it is called with the number of decodes and where in its prompt the step's
    first chunk starts (late chunks of a long prompt are slower), and returns the cap (stall-free batching,
    as in Sarathi-Serve). Without it, a step has the whole token budget. Under that cap a long prompt
    would hold the room for many steps, so the first waiting prompt whose uncached rest fits one step's
    room whole (a prefix hit, a short prompt) takes the room before running prompts' next chunks: they
    lose one step each time, and it gets its first token a step later instead of after them.

    `prefill_batch_tokens`: a step that already carries a prompt chunk takes another prompt's only while
    the step's prompt tokens stay within this. On CPU a forward of more tokens is no faster per token, so
    a second prompt in the step only delays the first one's first token (two 256-token prompts took 1,761 ms
    in one forward, 826 ms each alone: bench/HISTORY.md, "The quiet tenant no longer waits for a flood's whole
    prompt"); short prompts still share a step. None: up to the token budget (on GPUs, where a bigger forward
    is cheaper per token).

    Yielding: a prompt less urgent than one queued here within the last `yield_window_s` is computed in
    steps of at most `yield_cap` of their tokens (about `yield_slice_ms` of prefill, EngineConfig), so that a
    more urgent prompt arriving meanwhile waits for one such chunk, not for the whole prompt (the step
    after computes only its band: `_prompt_band`). Only while both kinds come: a lone tenant at one priority
    never pays for the smaller chunks."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 prefill_budget: Callable[[int, int], int] | None = None, prefill_batch_tokens: int | None = None):
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_batch_tokens = prefill_batch_tokens
        self.yield_window_s = config.yield_window_s
        self.urgency_seen: dict[float, float] = {}  # priority -> when a request of it was last queued
        self._yield_above: float | None = None  # this step's `yield_cap` priority
        self.yield_chunks = 0  # prompt chunks cut short so that a more urgent prompt can go next
        self.max_num_seqs = config.max_num_seqs
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_waits = 0  # times a waiting prompt waited for a running one to compute its prefix
        self.prefill_budget = prefill_budget  # (decodes, chunk start) -> tokens
        # LoRA slots (engine/lora.LoRAManager), with enable_lora: a request runs only once its adapter holds
        # one, so a step never mixes more adapters than there are slots. One whose adapter could not be read
        # any more waits in `lora_failed` for the engine to fail it.
        self.loras = None
        self.lora_failed: list[tuple[Request, Exception]] = []
        self.aging_s = config.priority_aging_s
        self.clock = time.monotonic

    def add(self, req: Request) -> None:
        """Queue behind every waiting request of its priority or a more urgent one (lower runs first)."""
        if req.base_priority is None:
            req.base_priority, req.queued_at = req.priority, self.clock()
        self.urgency_seen[req.priority] = self.clock()
        self._enqueue(req, front=False)

    def yields(self) -> float | None:
        """The priority above which prompts yield: the most urgent one queued here within `yield_window_s`,
        when a less urgent prompt has chunks to compute; None when no prompt yields."""
        if not self.urgency_seen:
            return None
        now = self.clock()
        for priority, seen in list(self.urgency_seen.items()):
            if now - seen > self.yield_window_s:
                del self.urgency_seen[priority]
        if len(self.urgency_seen) < 2:
            return None
        bound = min(self.urgency_seen)
        return bound if any(req.priority > bound and req.num_tokens - req.num_computed_tokens > 1
                            for req in (*self.running, *self.waiting)) else None

    def _age_waiting(self) -> None:
        """Bounded starvation: a waiting request's priority improves by one band per `aging_s` since it was
        queued (a preempted one keeps its age), so a stream of more urgent requests delays it by at most
        (its priority - theirs) x aging_s. Running requests keep the priority they had when admitted, which also
        makes them later victims of preemption. The queue is reordered (stably) when one changed band."""
        if self.aging_s is None or not self.waiting:
            return
        now, changed = self.clock(), False
        for req in self.waiting:
            if req.base_priority is None:  # queued by a path that did not stamp it: its wait counts from now
                req.base_priority, req.queued_at = req.priority, now
            aged = req.base_priority - int((now - req.queued_at) / self.aging_s)
            if aged < req.priority:
                req.priority, changed = aged, True
        if changed:
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.priority))

    def _enqueue(self, req: Request, front: bool) -> None:
        """Insert into `waiting` by priority: at the front of its band (`front`: a preempted request resumes
        first within it) or at its back."""
        position = len(self.waiting)
        for i, other in enumerate(self.waiting):
            if other.priority > req.priority or (front and other.priority == req.priority):
                position = i
                break
        self.waiting.insert(position, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_prompt_work(self) -> bool:
        """Whether a waiting or running request has more than its next token to compute."""
        return any(req.num_tokens - req.num_computed_tokens > 1 for req in (*self.waiting, *self.running))

    def schedule(self, token_cap: int | None = None,
                 yield_cap: tuple[float, int] | None = None) -> list[tuple[Request, int]]:
        """This step's (request, tokens to compute) pairs; `token_cap`, when given, is a smaller token budget
        for this step (a forward on borrowed cores); `yield_cap`, (priority, tokens): a chunk of a prompt less
        urgent than that priority has at most that many tokens (`yields`)."""
        budget = StepBudget(min(self.max_num_batched_tokens, token_cap or self.max_num_batched_tokens),
                            self._num_decodes() if self.prefill_budget is not None else 0)
        self._age_waiting()
        self._yield_above, budget.yield_room = yield_cap or (None, None)
        scheduled: list[tuple[Request, int]] = []
        band = self._prompt_band()
        if not self._schedule_running(budget, scheduled, self._short_prompt_waits(budget), band):
            self._schedule_waiting(budget, scheduled, band)
        if yield_cap is not None:
            self.yield_chunks += sum(1 for req, n in scheduled if n > 1 and self._yields(req, budget)
                                     and req.num_tokens - req.num_computed_tokens > n)
        return scheduled

    def _prompt_band(self) -> float | None:
        """The most urgent priority among the prompts to compute (running ones with chunks left, and the first
        waiting one that is not an import): a step computes prompt chunks of that band only, since a less
        urgent prompt beside them would only delay their first tokens (on CPU a bigger prefill step is no
        faster per token). Decodes are not held back. A waiting prompt counts only if it can be admitted now
        (a seat, free blocks for its whole prompt, and no running prompt computing its prefix for it to wait
        for): running prompts never stop for one that cannot. None without prompt work."""
        bands = [req.priority for req in self.running if req.num_tokens - req.num_computed_tokens > 1]
        first = self.waiting[0] if self.waiting else None
        if (first is not None and not first.num_computed_tokens and first.priority < min(bands, default=first.priority + 1)
                and len(self.running) < self.max_num_seqs
                and self.block_manager.num_free_blocks * self.block_manager.block_size >= first.num_tokens
                and not (bands and self._waits_for_prefix(first, self.block_manager.peek_computed_blocks(first),
                                                          self._computing_blocks()))):
            bands.append(first.priority)
        return min(bands, default=None)

    def _short_prompt_waits(self, budget: StepBudget) -> bool:
        """Whether the first waiting request is a prompt whose uncached rest fits this step's prefill room
        whole while a running prompt's chunks would take that room (only under a `prefill_budget`)."""
        if (self.prefill_budget is None or not self.waiting or len(self.running) >= self.max_num_seqs
                or not any(req.num_tokens - req.num_computed_tokens > 1 for req in self.running)):
            return False
        req = self.waiting[0]
        if req.num_computed_tokens:  # its KV was imported: it only decodes
            return False
        hits = self.block_manager.peek_computed_blocks(req)
        if self._waits_for_prefix(req, hits, self._computing_blocks()):
            return False  # it waits for a running prompt to compute its prefix: that one must go on
        cached = len(hits) * self.block_manager.block_size
        rest = req.num_tokens - cached
        return rest <= min(budget.tokens, self._prefill_budget(budget.num_decodes, cached))

    def _schedule_running(self, budget: StepBudget, scheduled: list[tuple[Request, int]],
                          yield_prefill: bool = False, band: float | None = None) -> bool:
        """Give running requests their next tokens (a decode, a draft to verify, or a prompt chunk), in order;
        with `yield_prefill`, no prompt chunks (a short waiting prompt takes the room). True when one of
        them had to preempt another for a block."""
        preempted = False
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget.tokens)
            if num_new > 1 and (yield_prefill or band is not None and req.priority > band):
                i += 1
                continue
            if num_new > 1:
                num_new = self._chunk(budget, num_new, req.num_computed_tokens, req)
                if num_new > 1 and not self._joins(budget, num_new):
                    i += 1
                    continue
            elif req.spec_token_ids:  # a decode verifying its draft: 1 + k query tokens
                del req.spec_token_ids[budget.tokens - 1:]
            if not num_new:  # a prefill chunk over the cap, or a beam waiting for its siblings' step
                i += 1
                continue
            while not self.block_manager.allocate_slots(req, num_new + len(req.spec_token_ids)):
                if req.spec_token_ids:  # drop the draft before preempting anyone for it
                    req.spec_token_ids = []
                    continue
                victim = self._victim(i)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new + len(req.spec_token_ids)))
                self._take(budget, req, num_new, len(req.spec_token_ids))
                i += 1
        return preempted

    def _schedule_waiting(self, budget: StepBudget, scheduled: list[tuple[Request, int]],
                          band: float | None = None) -> None:
        """Admit waiting requests in order while the budget, `max_num_seqs` and free blocks allow. A prompt
        whose next uncached block another admitted prompt is computing waits for it (and then finds it
        cached) instead of computing the same prefix beside it."""
        passed = 0  # waiting prompts this step has no prefill room for, or that wait for a prefix
        computing = None  # hashes of prompt blocks admitted prompts have yet to compute
        while passed < len(self.waiting) and budget.tokens > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[passed]
            # A request whose prompt KV was imported arrives with blocks and computed tokens.
            imported = req.num_computed_tokens > 0
            if not imported and self.block_manager.tiers is not None:
                self.block_manager.promote(req)  # what a lower tier holds of its prefix, if it was evicted since
            computed = [] if imported else self.block_manager.peek_computed_blocks(req)
            if not imported and self.block_manager.enable_prefix_caching:
                computing = self._computing_blocks() if computing is None else computing
                if self._waits_for_prefix(req, computed, computing):
                    self.prefix_waits += 1
                    passed += 1
                    continue
            if (budget.prefill == 0 or band is not None and req.priority > band) and not imported:
                # A prompt to compute, and this step's prefill room is spent (a running prompt's chunk took
                # it), or the step computes a more urgent prompt, which a less urgent one would only slow
                # down: requests behind it whose KV was imported only decode, and need not wait for it.
                passed += 1
                continue
            if req.lora is not None and req.lora_slot < 0:
                pinned = self._acquire_lora(req)
                if pinned is None:
                    continue
                if not pinned:  # every slot serves other adapters' running requests
                    passed += 1
                    continue
            num_cached = req.num_computed_tokens or len(computed) * self.block_manager.block_size
            num_new = min(req.num_tokens - num_cached, budget.tokens)
            if num_new > 1:
                num_new = self._chunk(budget, num_new, num_cached, req)
                if not num_new and not self._yields(req, budget):
                    self._release_lora(req)
                    break
                if not num_new or num_new > 1 and not self._joins(budget, num_new):
                    # It yields and the step's room for such prompts is spent, or a prompt computes beside it
                    self._release_lora(req)
                    passed += 1
                    continue
            if not self.block_manager.allocate_slots(req, num_new, computed):
                self._release_lora(req)
                break
            if not imported:  # counted once it is admitted, not at every step it waited for blocks
                self.block_manager.count_lookup(req, computed)
            del self.waiting[passed]
            self._admit(req, num_cached, imported)
            scheduled.append((req, num_new))
            self._take(budget, req, num_new)
            if computing is not None:
                computing.update(req.block_hashes[num_cached // self.block_manager.block_size:])

    def _acquire_lora(self, req: Request) -> bool | None:
        """Pin a slot holding `req`'s adapter: True; False while every slot serves others; None when the adapter
        cannot be read any more (`req` leaves the queue for lora_failed)."""
        from engine.lora import LoRAError
        try:
            slot = self.loras.acquire(req.lora)
        except LoRAError as exc:
            self.waiting.remove(req)
            self.lora_failed.append((req, exc))
            return None
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.loras.release(req.lora_slot)
            req.lora_slot = -1

    @staticmethod
    def _waits_for_prefix(req: Request, hits: list[int], computing: set[int]) -> bool:
        """Whether the first block of `req` past its cached `hits` is one an admitted prompt is computing."""
        return len(hits) < len(req.block_hashes) and req.block_hashes[len(hits)] in computing

    def _computing_blocks(self) -> set[int]:
        """Hashes of the full prompt blocks running requests have not computed yet."""
        size = self.block_manager.block_size
        return {h for req in self.running for h in req.block_hashes[req.num_computed_tokens // size:]}

    def _chunk(self, budget: StepBudget, num_new: int, start: int, req: Request) -> int:
        """`num_new` prompt tokens from `start` on, cut to the step's prefill room (set at its first chunk,
        for where in its prompt that chunk starts), and to the step's room for yielding prompts when `req`
        yields."""
        if budget.prefill is None:
            budget.prefill = self._prefill_budget(budget.num_decodes, start)
        if self._yields(req, budget):
            num_new = min(num_new, budget.yield_room)
        return min(num_new, budget.prefill)

    def _yields(self, req: Request, budget: StepBudget) -> bool:
        return budget.yield_room is not None and req.priority > self._yield_above

    def _take(self, budget: StepBudget, req: Request, num_new: int, num_drafts: int = 0) -> None:
        budget.take(num_new, num_drafts)
        if num_new > 1 and self._yields(req, budget):
            budget.yield_room -= num_new

    def _joins(self, budget: StepBudget, num_new: int) -> bool:
        """Whether a prompt chunk of `num_new` tokens may join the step (`prefill_batch_tokens`)."""
        return (not budget.prompt_tokens or self.prefill_batch_tokens is None
                or budget.prompt_tokens + num_new <= self.prefill_batch_tokens)

    def _admit(self, req: Request, num_cached: int, imported: bool) -> None:
        """Run `req` from `num_cached` tokens on; its first admission stamps its timeline (the decode of an
        imported prompt, or the prefill of its own) and fixes its cached-token count."""
        req.num_computed_tokens = num_cached
        if not req.scheduled:
            req.scheduled = True
            req.num_cached_tokens = num_cached
            req.timeline.stamp("decode_started" if imported else "prefill_started")
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def add_forked(self, children: list[Request]) -> None:
        """Queue forks first: they hold their parent's blocks and join the next step."""
        now = self.clock()
        for child in reversed(children):
            child.status = RequestStatus.WAITING
            if child.base_priority is None:
                child.base_priority, child.queued_at = child.priority, now
            self.waiting.appendleft(child)

    def replace(self, old: Request, new: Request) -> None:
        """Put `new` where `old` is queued or running (a candidate taking over an aborted parent's prompt)."""
        queue = self.running if old in self.running else self.waiting
        if old in queue:
            queue[queue.index(old)] = new
            new.status = old.status
            if new.base_priority is None:  # it waits as long as the one it replaces has
                new.base_priority, new.queued_at = old.base_priority, old.queued_at

    def _num_decodes(self) -> int:
        return sum(1 for req in self.running if req.num_tokens - req.num_computed_tokens == 1)

    def _prefill_budget(self, num_decodes: int, start: int) -> int:
        """Prompt tokens this step may carry, for a chunk starting `start` tokens into its prompt: the cap
        for its decodes (with none, the cap that keeps the step short enough for a stream that joins
        meanwhile), or the whole budget without a cap."""
        if self.prefill_budget is None:
            return self.max_num_batched_tokens
        return max(1, self.prefill_budget(num_decodes, start))

    def finish(self, req: Request, free_blocks: bool = True) -> None:
        """Remove a finished or aborted request; its freed blocks stay in the prefix cache.

        `free_blocks=False` hands the blocks to the caller (a prefill worker leasing them to decode)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if free_blocks:
            self.block_manager.free(req)
        self._release_lora(req)
        req.status = RequestStatus.FINISHED

    def _victim(self, i: int) -> Request:
        """Whom to preempt for running[i]'s block: of it and those after it (not scheduled this step yet),
        the least urgent, then the most recently admitted (vLLM's priority policy; without priorities, the
        last admitted)."""
        newest_first = range(len(self.running) - 1, i - 1, -1)
        return self.running[max(newest_first, key=lambda j: self.running[j].priority)]  # the first of the max

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        self._release_lora(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self._enqueue(req, front=True)
