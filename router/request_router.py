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
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace

import ray

from router.metrics import Metrics
from engine import hashing
from engine.outputs import RequestOutput
from worker_runtime.protocol import GenerateRequest
from engine.sampling_params import candidate_id, candidate_seed
from worker_runtime.serving import WorkerDraining
from engine.timeline import RequestTimeline
from router.dispatch import run_request
from router.streams import merge_streams
from router.latency_report import LatencyReporter
from router.policy import EXPECTED_OUTPUT_TOKENS, NoDecodeWorker, RouteDecision
from router.worker_view import WorkerView

logger = logging.getLogger(__name__)

# A request waiting for a prefill slot routes again on every load report, and at least this often.
PREFILL_SLOT_POLL_S = 0.1
# Likewise a request waiting for a decode worker (every membership change and load report wakes it).
DECODE_WAIT_POLL_S = 0.5


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
        # Requests waiting for a prefill slot, in the order they began to: id -> (prefill worker, prompt tokens).
        self.slot_waiters: dict[str, tuple[str, int]] = {}

    async def stream(self, request: GenerateRequest, block_hashes: Sequence[int]) -> AsyncIterator[RequestOutput]:
        """Yield the request's token deltas (each of its n candidates' under its `index`, all run on one
        decode worker). Closing the iterator aborts it on every worker it runs on.

        Raises NoDecodeWorker when no decode worker can take it (none came within `decode_wait_s`), and
        InvalidRequestError when a worker refuses it (both before anything was yielded). When several
        candidates' decode worker fails mid-stream, each unfinished one migrates alone."""
        excluded: set[str] = set()
        token_times: list[list[float]] = [[] for _ in range(request.num_outputs)]
        streamed: list[list[int]] = [[] for _ in range(request.num_outputs)]  # what the client has, per candidate
        done: set[int] = set()  # candidates finished
        attempts = migrations = 0
        times = request.times
        failure: tuple[str, Exception] | None = None  # the worker and error that ended the last placement
        while attempts < self.max_attempts:
            try:
                decision = await self._route(request, block_hashes, excluded)
            except NoDecodeWorker as exc:
                if not token_times[0]:
                    raise
                yield self._give_up(request, *failure, token_times[0], str(exc))  # nowhere to migrate to
                return
            decode = decision.decode.worker_id
            prefill = decision.prefill.worker_id if decision.prefill else None
            migrating = False
            try:
                actors = self.view.actor(decode), prefill and self.view.actor(prefill)
                async with aclosing(run_request(request, *actors, layerwise=self.layerwise)) as deltas:
                    async for delta in deltas:
                        if delta.new_token_ids:
                            # A coalesced delta's tokens arrive together: one stamp each, so ITL is
                            # still counted per token and averages to TPOT.
                            now = time.time()
                            token_times[delta.index].extend([now] * len(delta.new_token_ids))
                            streamed[delta.index].extend(delta.new_token_ids)
                            times.setdefault("first_token", now)
                            times["last_token"] = now
                        # Each worker stamps its own copy of the request; gather the stages here.
                        request.timeline.merge(delta.timeline)
                        if delta.finished:
                            done.add(delta.index)
                            if len(done) == request.num_outputs:
                                request.stamp("finished")
                            self._observe(decode, request.timeline, token_times[delta.index], delta.finish_reason)
                        yield delta
                return
            except (WorkerDraining, ray.exceptions.RayActorError) as exc:
                started = any(token_times)
                # Before the first delta, only the prefill call (when there is one) has run.
                failed = prefill if prefill is not None and not started else decode
                if isinstance(exc, ray.exceptions.RayActorError):
                    # Unschedulable until a later call succeeds: a worker Ray restarts may take it again.
                    self.view.lost(failed, type(exc).__name__)
                else:
                    excluded.add(failed)
                failure = failed, exc
                if not started:
                    attempts += 1
                    pool = "prefill" if failed == prefill else "decode"
                    cause = "draining" if isinstance(exc, WorkerDraining) else "failed"
                    self.metrics.reroutes.labels(pool, failed, cause).inc()
                    logger.info("re-routing %s away from %s (attempt %d): %s", request.request_id, failed,
                                attempts, type(exc).__name__)
                    continue
                if request.num_outputs > 1:
                    migrating = True
                    break
                if migrations == self.migration_limit:
                    done.add(0)
                    yield self._give_up(request, decode, exc, token_times[0], f"{migrations} migrations already")
                    return
                migrations += 1
                migrating = True
                self.metrics.migrations.labels(failed).inc()
                logger.warning("migrating %s from %s after %d tokens (migration %d): %s", request.request_id,
                               failed, len(streamed[0]), migrations, type(exc).__name__)
                block_hashes = self._resume(request, block_hashes, streamed[0])
            finally:
                self.view.end(decision, request.request_id)
                if not migrating:  # the client went away mid-stream
                    for i, stamps in enumerate(token_times):
                        if stamps and i not in done:
                            self._observe(decode, request.timeline, stamps, "abort")
        else:
            self.metrics.rejected.labels("no_decode_worker").inc()
            raise NoDecodeWorker(f"no worker could take the request in {self.max_attempts} attempts")
        async for delta in self._migrate_candidates(request, block_hashes, streamed, done, failure[0]):
            yield delta

    async def _migrate_candidates(self, request: GenerateRequest, block_hashes: Sequence[int],
                                  streamed: list[list[int]], done: set[int],
                                  failed: str) -> AsyncIterator[RequestOutput]:
        """Each unfinished candidate of `request` as a request of its own with the tokens it streamed (placed
        and migrated alone from here on), their deltas under the candidates' indexes."""
        params = request.sampling_params
        indexes = [i for i in range(request.num_outputs) if i not in done]
        streams = []
        for i in indexes:
            self.metrics.migrations.labels(failed).inc()
            alone = GenerateRequest(candidate_id(request.request_id, i), request.prompt_token_ids,
                                    replace(params, n=1, seed=candidate_seed(params.seed, i)), request.cache_salt,
                                    request.timeline.copy(), placements=request.placements)
            streams.append(self.stream(alone, self._resume(alone, block_hashes, streamed[i])))
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
        return hashing.extend_block_hashes(list(block_hashes), context, self.view.block_size, request.cache_salt)

    def _give_up(self, request: GenerateRequest, worker: str, exc: Exception, token_times: list[float],
                 why: str) -> RequestOutput:
        """The last delta of a stream that cannot go on: finish_reason "error", naming the failed worker and
        why the request could not move on."""
        self._observe(worker, request.timeline, token_times, "error")
        error = f"worker {worker} failed mid-stream ({type(exc).__name__}) and the request cannot move on: {why}"
        logger.warning("%s: %s", request.request_id, error)
        return RequestOutput(request.request_id, [], "", finished=True, finish_reason="error", error=error)

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
                                               prefill_backlog=self._backlog_ahead_of(request.request_id))
                except NoDecodeWorker:
                    decode_wait = decode_wait or _DecodeWait(request, self.decode_wait_s, self.metrics)
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
                    decision.prefill.worker_id, request.num_context_tokens - decision.prefill.cached_tokens)
                await self.view.wait_for_loads(PREFILL_SLOT_POLL_S)
        finally:
            self.slot_waiters.pop(request.request_id, None)
        if waited_since is not None:
            self.metrics.prefill_queue_wait.labels("remote" if decision.prefill else "local").observe(
                time.monotonic() - waited_since)
        request.stamp("routed")
        request.placements.append({"prefill": decision.prefill.worker_id if decision.prefill else None,
                                   "decode": decision.decode.worker_id})
        _record(request.timeline, decision, self.view.block_size)
        self.view.begin(decision, request.request_id, request.num_context_tokens)
        return decision

    def _backlog_ahead_of(self, request_id: str) -> dict[str, tuple[int, int]]:
        """Per prefill worker, the (requests, prompt tokens) waiting here for a slot there that began to wait
        before `request_id` (all of them for a request not waiting yet): the slots they take first."""
        backlog: dict[str, tuple[int, int]] = {}
        for waiter, (worker_id, tokens) in self.slot_waiters.items():
            if waiter == request_id:
                break
            requests, queued = backlog.get(worker_id, (0, 0))
            backlog[worker_id] = (requests + 1, queued + tokens)
        return backlog

    def _observe(self, worker: str, timeline: RequestTimeline, token_times: list[float],
                 finish_reason: str | None) -> None:
        self.metrics.observe_finished("decode", worker, timeline, token_times, finish_reason)
        self.latencies.add(timeline.times.get("arrival"), token_times)


def expected_output_tokens(request: GenerateRequest) -> int:
    """What the request will likely still generate, for placement: its remaining max_tokens, capped."""
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is None:
        return EXPECTED_OUTPUT_TOKENS
    return max(1, min(max_tokens - len(request.output_token_ids), EXPECTED_OUTPUT_TOKENS))


def _record(timeline: RequestTimeline, decision: RouteDecision, block_size: int) -> None:
    """The routing decision, in the request's timeline."""
    timeline.decode_worker = decision.decode.worker_id
    timeline.decode_overlap_blocks = decision.decode.cached_tokens // block_size
    if decision.prefill is not None:
        timeline.prefill_worker = decision.prefill.worker_id
        timeline.prefill_overlap_blocks = decision.prefill.cached_tokens // block_size
        timeline.prefill_path = "remote"
    else:
        timeline.prefill_worker, timeline.prefill_overlap_blocks = None, 0
        timeline.prefill_path = "local"
    timeline.routing_reason = decision.reason
    timeline.predicted_ttft_s = decision.predicted_ttft_s


class _DecodeWait:
    """One request's wait for a schedulable decode worker, bounded by `limit_s`, counted by how it ended."""

    def __init__(self, request: GenerateRequest, limit_s: float, metrics: Metrics):
        self.request = request
        self.stage = "migration" if request.output_token_ids else "arrival"
        self.metrics = metrics
        self.deadline = time.monotonic() + limit_s
        self.limit_s = limit_s
        self.waiting = False
        self.reason = ""

    async def wait(self, view: WorkerView) -> bool:
        """Wait a little for the decode pool to change; False (with `reason` set) once waiting is pointless:
        the pool cannot heal, or the bound passed."""
        remaining = self.deadline - time.monotonic()
        if not view.can_heal("decode"):
            self.reason = "no decode worker is healthy and every one is draining"
            return self._end("unhealable")
        if remaining <= 0:
            self.reason = f"no decode worker became available within {self.limit_s:g} s"
            return self._end("timeout")
        if not self.waiting:
            self.waiting = True
            logger.warning("%s: no decode worker is schedulable; waiting up to %g s for one (%s)",
                           self.request.request_id, remaining, self.stage)
        await view.wait_for_loads(min(remaining, DECODE_WAIT_POLL_S))
        return True

    def found(self) -> None:
        if self.waiting:
            logger.info("%s: a decode worker is back; going on", self.request.request_id)
            self._end("found")

    def _end(self, outcome: str) -> bool:
        if self.waiting:
            self.waiting = False
            self.metrics.decode_waits.labels(self.stage, outcome).inc()
        return False
