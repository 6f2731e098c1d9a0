"""Runs one sequence through the cluster: place it, run it, re-place it if its worker fails.

A worker that is draining or dead before anything reached the client (a prefill worker killed
mid-prefill, say) is routed around and the request is placed again (a bounded number of times,
counted in tandem:request_reroutes). A decode worker that dies once tokens went out has its request
migrated (Dynamo's name): placed on another decode worker with the tokens streamed so far, which it
prefills locally (prompt + those tokens) and continues after, so the client's stream goes on. Only past
`migration_limit` migrations does the stream end with finish_reason "error".

When no decode worker is schedulable but the pool can heal (Ray restarting a crashed worker in place,
the controller replacing a dead one), a request waits up to `decode_wait_s` for one, whether it just
arrived or is migrating, and goes on there: the only decode worker's crash costs the client a pause, not
its stream (tandem:decode_worker_waits).

A migrated request continues with the tokens and text it would have had on one worker: greedy ones
because the new worker recomputes the same context, seeded ones because its generator first skips the
draws the streamed tokens took (Engine.add).
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from enum import Enum

import ray

from router.metrics import Metrics
from engine import hashing
from engine.outputs import RequestOutput
from engine.step_costs import bucket
from worker_runtime.protocol import GenerateRequest
from worker_runtime.serving import WorkerDraining
from engine.timeline import RequestTimeline
from router.placement.dispatch import run_request
from router.placement.streams import merge_streams
from router.placement.latency_report import LatencyReporter
from router.placement.routing import NoDecodeWorker, RouteDecision, dispatch_path, expected_output_tokens
from router.placement.decode_wait import DecodeWait
from router.placement.worker_view import WorkerView

logger = logging.getLogger(__name__)

# A request waiting for a prefill slot routes again on every load report, and at least this often.
PREFILL_SLOT_POLL_S = 0.1


class _Next(Enum):
    """What follows a placement that ended."""
    END = "end"  # the stream is over: finished, given up, or the client went away
    REROUTE = "reroute"  # a worker failed before anything reached the client: place the request again
    MIGRATE = "migrate"  # its decode worker failed mid-stream: resume on another one
    SPLIT = "split"  # a group's decode worker failed mid-stream: each unfinished candidate migrates alone


@dataclass(slots=True)
class _Routing:
    """One request's routing state across its placements (re-routes and migrations)."""
    request: GenerateRequest
    block_hashes: Sequence[int]  # of its context: the prompt, and after a migration the tokens streamed
    excluded: set[str] = field(default_factory=set)  # draining workers it failed on
    token_times: list[list[float]] = field(init=False)  # per candidate, when each token arrived
    streamed: list[list[int]] = field(init=False)  # per candidate, what the client has
    done: set[int] = field(default_factory=set)  # candidates finished
    attempts: int = 0  # placements before the first token
    migrations: int = 0
    failure: tuple[str, Exception] | None = None  # the worker and error that ended the last placement
    next: _Next = _Next.END
    # A chunked local prefill beside streams: (its uncached tokens, its unscaled predicted seconds, when it was
    # placed), until its first token measures it (Router.observe_local_prefill).
    local_model: tuple[int, float, float] | None = None

    def __post_init__(self):
        self.token_times = [[] for _ in range(self.request.num_outputs)]
        self.streamed = [[] for _ in range(self.request.num_outputs)]

    @property
    def started(self) -> bool:
        """Whether any token reached the client."""
        return any(self.token_times)


class RequestRouter:
    """Places and runs GenerateRequests, and observes each one's latencies when it ends."""

    def __init__(self, view: WorkerView, metrics: Metrics, latencies: LatencyReporter, max_attempts: int = 3,
                 migration_limit: int = 3, decode_wait_s: float = 60.0, layerwise: bool = False):
        self.view = view
        self.layerwise = layerwise  # the prefill workers lease KV before the first token (transfer.layerwise)
        self.metrics = metrics
        self.latencies = latencies
        self.max_attempts = max_attempts  # placements before the first token
        self.migration_limit = migration_limit  # placements after it
        self.decode_wait_s = decode_wait_s  # for a decode worker, while none is schedulable and the pool can heal
        # Requests waiting for a prefill slot, in the order they began to: id -> (prefill worker, prompt tokens,
        # priority).
        self.slot_waiters: dict[str, tuple[str, int, int]] = {}

    def predict_ttft(self, block_hashes: Sequence[int], prompt_tokens: int, priority: int, elapsed_s: float,
                     output_tokens: int, ingress_ahead: tuple[int, int] = (0, 0)) -> float | None:
        """A request's predicted seconds to its first token from arrival, were it placed now (None: no
        prediction): behind the prefill-slot waiters that go before it (`_backlog_ahead_of`) and
        `ingress_ahead`, the (requests, prompt tokens) queued at the ingress before it, which go first on
        whichever path (Router.route's `ingress_backlog`)."""
        return self.view.predict_ttft(block_hashes, prompt_tokens, elapsed_s, output_tokens,
                                      self._backlog_ahead_of("", priority), ingress_ahead)

    def would_wait(self, block_hashes: Sequence[int], prompt_tokens: int, priority: int, elapsed_s: float,
                   output_tokens: int) -> bool:
        """Whether the request, placed now, would wait here for a prefill slot (behind the waiters that go
        before it): the ingress queue then holds it, where it is ordered by tenant share too. Only a full prefill
        queue makes placement wait (cost_model.disaggregate), so without one, and with no waiter ahead, the
        placement's preview is skipped: the common case costs a look at the prefill workers' queue lengths."""
        backlog = self._backlog_ahead_of("", priority)
        if not backlog and not self.view.some_prefill_queue_full():
            return False
        decision = self.view.preview(block_hashes, prompt_tokens, elapsed_s, output_tokens, backlog)
        return decision is not None and decision.wait

    def saturated(self) -> bool:
        """Whether placing more requests now would only queue them: some already wait here for a prefill
        slot, or every worker already has prompts queued (`WorkerView.saturated`: full prefill queues and
        waiting prompts on every decode worker, or, colocated, the latter alone). The ingress queue
        (router/api/flow_control.py) then holds new ones and lets them on by rule."""
        return bool(self.slot_waiters) or self.view.saturated()

    async def stream(self, request: GenerateRequest, block_hashes: Sequence[int],
                     on_placed: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's token deltas (each of its n candidates' under its `index`, all run on one
        decode worker). Closing the iterator aborts it on every worker it runs on. `on_placed()` runs once,
        when the first placement is made or has failed: the workers' loads count the request from then on.

        Raises NoDecodeWorker when no decode worker can take it (none came within `decode_wait_s`), and
        InvalidRequestError when a worker refuses it (both before anything was yielded). When several
        candidates' decode worker fails mid-stream, each unfinished one migrates alone."""
        state = _Routing(request, block_hashes)
        while state.attempts < self.max_attempts:
            try:
                decision = await self._route(request, state.block_hashes, state.excluded)
            except NoDecodeWorker as exc:
                if not state.token_times[0]:
                    raise
                yield self._give_up(state, str(exc))  # nowhere to migrate to
                return
            finally:  # placed, refused, or given up while waiting for a slot: nothing more to place
                if on_placed is not None:
                    on_placed, placed = None, on_placed
                    placed()
            async with aclosing(self._attempt(state, decision)) as deltas:
                async for delta in deltas:
                    yield delta
            if state.next is _Next.END:
                return
            if state.next is _Next.SPLIT:
                break
        else:
            self.metrics.rejected.labels("no_decode_worker").inc()
            raise NoDecodeWorker(f"no worker could take the request in {self.max_attempts} attempts")
        async for delta in self._migrate_candidates(state):
            yield delta

    async def _attempt(self, state: _Routing, decision: RouteDecision) -> AsyncIterator[RequestOutput]:
        """Run the request on one placement, yielding its deltas; when a worker fails, `state.next` says
        what follows (the give-up delta, when that is what follows, is the last one yielded)."""
        request = state.request
        decode = decision.decode.worker_id
        prefill = decision.prefill.worker_id if decision.prefill else None
        state.next = _Next.END
        request.prefix_source = None
        state.local_model = None if decision.local_model_s is None else (decision.local_tokens,
                                                                          decision.local_model_s, time.time())
        if not request.output_token_ids:  # the worker computing the prompt pulls what a peer holds of it, if that pays
            request.prefix_source = self.view.peer_prefix(prefill or decode, state.block_hashes,
                                                          len(request.prompt_token_ids))
        try:
            actors = self.view.actor(decode), prefill and self.view.actor(prefill)
            async with aclosing(run_request(request, *actors)) as deltas:
                async for delta in deltas:
                    self._received(state, decode, delta)
                    yield delta
        except (WorkerDraining, ray.exceptions.RayActorError) as exc:
            give_up = self._failed(state, decode, prefill, exc)
            if give_up is not None:
                yield give_up
        finally:
            self.view.end(decision, request.request_id)
            if state.next not in (_Next.MIGRATE, _Next.SPLIT):  # the client went away mid-stream
                for i, stamps in enumerate(state.token_times):
                    if stamps and i not in state.done:
                        self._observe(decode, request.timeline, stamps, "abort")

    def _received(self, state: _Routing, decode: str, delta: RequestOutput) -> None:
        """Time a delta's tokens and keep them (a migration resumes after them); observe a finished candidate."""
        request = state.request
        if delta.new_token_ids:
            # A coalesced delta's tokens arrive together: one stamp each, so ITL is still counted per
            # token and averages to TPOT.
            now = time.time()
            state.token_times[delta.index].extend([now] * len(delta.new_token_ids))
            state.streamed[delta.index].extend(delta.new_token_ids)
            request.times.setdefault("first_token", now)
            request.times["last_token"] = now
            if state.local_model is not None:
                (tokens, model_s, placed_at), state.local_model = state.local_model, None
                self.view.router.observe_local_prefill(tokens, model_s, now - placed_at)
                self.metrics.local_factor.labels(str(bucket(tokens))).set(self.view.router.local_factor(tokens))
        # Each worker stamps its own copy of the request; gather the stages here.
        request.timeline.merge(delta.timeline)
        if delta.finished:
            state.done.add(delta.index)
            if len(state.done) == request.num_outputs:
                request.stamp("finished")
            self._observe(decode, request.timeline, state.token_times[delta.index], delta.finish_reason)

    def _failed(self, state: _Routing, decode: str, prefill: str | None, exc: Exception) -> RequestOutput | None:
        """Route around the worker that failed: place the request again if nothing reached the client yet,
        else migrate it. Returns the give-up delta when it can move no more."""
        started = state.started
        # Before the first delta, only the prefill call (when there is one) has run.
        failed = prefill if prefill is not None and not started else decode
        if isinstance(exc, ray.exceptions.RayActorError):
            # Unschedulable until a later call succeeds: a worker Ray restarts may take it again.
            self.view.lost(failed, type(exc).__name__)
        else:
            state.excluded.add(failed)
        state.failure = failed, exc
        if started:
            return self._migrate(state, failed, exc)
        state.attempts += 1
        state.next = _Next.REROUTE
        pool = "prefill" if failed == prefill else "decode"
        cause = "draining" if isinstance(exc, WorkerDraining) else "failed"
        self.metrics.reroutes.labels(pool, failed, cause).inc()
        logger.info("re-routing %s away from %s (attempt %d): %s", state.request.request_id, failed,
                    state.attempts, type(exc).__name__)
        return None

    def _migrate(self, state: _Routing, failed: str, exc: Exception) -> RequestOutput | None:
        """The migration step, once tokens went out: a group of candidates splits (each migrates alone); a
        single sequence resumes after its streamed tokens, unless it used up `migration_limit`."""
        request = state.request
        if request.num_outputs > 1:
            state.next = _Next.SPLIT
            return None
        if state.migrations == self.migration_limit:
            state.done.add(0)
            return self._give_up(state, f"{state.migrations} migrations already")
        state.migrations += 1
        state.next = _Next.MIGRATE
        self.metrics.migrations.labels(failed).inc()
        logger.warning("migrating %s from %s after %d tokens (migration %d): %s", request.request_id,
                       failed, len(state.streamed[0]), state.migrations, type(exc).__name__)
        state.block_hashes = self._resume(request, state.block_hashes, state.streamed[0])
        return None

    async def _migrate_candidates(self, state: _Routing) -> AsyncIterator[RequestOutput]:
        """Each unfinished candidate of the request as a request of its own with the tokens it streamed
        (placed and migrated alone from here on), their deltas under the candidates' indexes."""
        request, failed = state.request, state.failure[0]
        indexes = [i for i in range(request.num_outputs) if i not in state.done]
        streams = []
        for i in indexes:
            self.metrics.migrations.labels(failed).inc()
            alone = request.candidate(i)
            alone.placements = request.placements  # where the group and each candidate went, in one list
            streams.append(self.stream(alone, self._resume(alone, state.block_hashes, state.streamed[i])))
        logger.warning("migrating %d candidates of %s from %s, each alone", len(indexes), request.request_id, failed)
        async with aclosing(merge_streams(streams)) as merged:
            async for k, delta in merged:
                delta.index = indexes[k]
                yield delta

    def _resume(self, request: GenerateRequest, block_hashes: Sequence[int], streamed: list[int]) -> list[int]:
        """Make `request` continue after the tokens already streamed; returns the block hashes of its
        new context (prompt + those tokens), extending the prompt's."""
        request.output_token_ids = list(streamed)
        context = request.prompt_token_ids + request.output_token_ids
        return hashing.extend_block_hashes(list(block_hashes), context, self.view.block_size, request.cache_salt,
                                           request.lora_key)

    def _give_up(self, state: _Routing, why: str) -> RequestOutput:
        """The last delta of a stream that cannot go on: finish_reason "error", naming the failed worker and
        why the request could not move on."""
        worker, exc = state.failure
        state.next = _Next.END
        self._observe(worker, state.request.timeline, state.token_times[0], "error")
        error = f"worker {worker} failed mid-stream ({type(exc).__name__}) and the request cannot move on: {why}"
        logger.warning("%s: %s", state.request.request_id, error)
        return RequestOutput(state.request.request_id, [], "", finished=True, finish_reason="error", error=error)

    async def _route(self, request: GenerateRequest, block_hashes: Sequence[int], excluded: set[str]) -> RouteDecision:
        """Place the request. While the prefill queue is full and the remote path still meets the TTFT SLO,
        wait for a slot and route again; once waiting would miss the SLO, the policy turns to local prefill
        if that meets it or comes sooner. Waiters count as queued for those behind them (`slot_waiters`) and
        wake in the order they began to wait."""
        waited_since = decode_wait = None
        try:
            while True:
                try:
                    # A migrated request prefills on its decode worker: a prefill worker hands over prompt KV
                    # only. So does a beam search: its beams need the prompt's logits where they run.
                    decision = self.view.route(block_hashes, request.num_context_tokens, excluded,
                                               remote_prefill=not (request.output_token_ids or
                                                                   request.sampling_params.use_beam_search),
                                               elapsed_s=max(0.0, time.time() - request.times["arrival"]),
                                               output_tokens=expected_output_tokens(request),
                                               prefill_backlog=None if request.ahead else self._backlog_ahead_of(
                                                   request.request_id, request.priority),
                                               ahead=request.ahead, lora_key=request.lora_key)
                except NoDecodeWorker:
                    decode_wait = decode_wait or DecodeWait(request, self.decode_wait_s, self.metrics)
                    if await decode_wait.wait(self.view):
                        continue
                    self.metrics.rejected.labels("no_decode_worker").inc()
                    raise NoDecodeWorker(decode_wait.reason) from None
                if decode_wait is not None:
                    decode_wait.found()
                if not decision.wait:
                    break
                waited_since = waited_since or time.monotonic()
                self.slot_waiters[request.request_id] = (
                    decision.prefill.worker_id, request.num_context_tokens - decision.prefill.cached_tokens,
                    request.priority)
                await self.view.wait_for_loads(PREFILL_SLOT_POLL_S)
        finally:
            self.slot_waiters.pop(request.request_id, None)
        if waited_since is not None:
            self.metrics.prefill_queue_wait.labels("remote" if decision.prefill else "local").observe(
                time.monotonic() - waited_since)
        request.stamp("routed")
        request.dispatch = dispatch_path(request, decision.prefill is not None, self.layerwise)
        request.placements.append({"prefill": decision.prefill.worker_id if decision.prefill else None,
                                   "decode": decision.decode.worker_id})
        decision.record(request.timeline, self.view.block_size)
        self.view.begin(decision, request.request_id, request.num_context_tokens, block_hashes)
        return decision

    def _backlog_ahead_of(self, request_id: str, priority: int = 0) -> dict[str, tuple[int, int]]:
        """Per prefill worker, the (requests, prompt tokens) waiting here for a slot there that take the
        slots before `request_id` (of `priority`): the more urgent ones, and those of its priority that began
        to wait before it (all of them for a request not waiting yet)."""
        backlog: dict[str, tuple[int, int]] = {}
        before = True
        for waiter, (worker_id, tokens, waiter_priority) in self.slot_waiters.items():
            before = before and waiter != request_id
            if waiter == request_id or waiter_priority > priority or (waiter_priority == priority and not before):
                continue
            requests, queued = backlog.get(worker_id, (0, 0))
            backlog[worker_id] = (requests + 1, queued + tokens)
        return backlog

    def _observe(self, worker: str, timeline: RequestTimeline, token_times: list[float],
                 finish_reason: str | None) -> None:
        self.metrics.observe_finished("decode", worker, timeline, token_times, finish_reason)
        self.latencies.add(timeline.times.get("arrival"), token_times)
