"""Runs one sequence through the cluster: place it, run it, re-place it if its worker fails.

A worker that is draining or dead before anything reached the client is excluded and the request is
placed again (a bounded number of times). A decode worker that dies once tokens went out has its
request migrated (Dynamo's name): placed on another decode worker with the tokens streamed so far, which
it prefills locally (prompt + those tokens) and continues after, so the client's stream goes on. Only
past `migration_limit` migrations does the stream end with finish_reason "error".

A migrated request continues with the tokens and text it would have had on one worker: greedy ones
because the new worker recomputes the same context, seeded ones because its generator first skips the
draws the streamed tokens took (Engine.add).
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

import ray

from router.metrics import Metrics
from engine import hashing
from engine.protocol import GenerateRequest, TokenDelta
from engine.serving import WorkerDraining
from router.dispatch import run_request
from router.latency_report import LatencyReporter
from router.policy import NoDecodeWorker, RouteDecision
from router.worker_view import WorkerView

logger = logging.getLogger(__name__)

# A request waiting for a prefill slot routes again on every load report, and at least this often.
PREFILL_SLOT_POLL_S = 0.1


class RequestRouter:
    """Places and runs GenerateRequests, and observes each one's latencies when it ends."""

    def __init__(self, view: WorkerView, metrics: Metrics, latencies: LatencyReporter, max_attempts: int = 3,
                 migration_limit: int = 3):
        self.view = view
        self.metrics = metrics
        self.latencies = latencies
        self.max_attempts = max_attempts  # placements before the first token
        self.migration_limit = migration_limit  # placements after it

    async def stream(self, request: GenerateRequest, block_hashes: Sequence[int]) -> AsyncIterator[TokenDelta]:
        """Yield the request's token deltas. Closing the iterator aborts it on every worker it runs on.

        Raises NoDecodeWorker when no decode worker can take it, and InvalidRequestError when a worker
        refuses it (both before anything was yielded)."""
        excluded: set[str] = set()
        token_times: list[float] = []
        streamed: list[int] = []  # token ids the client has, over every worker the request ran on
        attempts = migrations = 0
        failure: tuple[str, Exception] | None = None  # the worker and error that ended the last placement
        while attempts < self.max_attempts:
            try:
                decision = await self._route(request, block_hashes, excluded)
            except NoDecodeWorker:
                if not token_times:
                    raise
                yield self._give_up(request, *failure, token_times)  # the last worker left as we migrated
                return
            decode = decision.decode.worker_id
            prefill = decision.prefill.worker_id if decision.prefill else None
            finished = migrating = False
            try:
                actors = self.view.actor(decode), prefill and self.view.actor(prefill)
                async with aclosing(run_request(request, *actors)) as deltas:
                    async for delta in deltas:
                        if delta.token_ids:
                            # A coalesced delta's tokens arrive together: one stamp each, so ITL is
                            # still counted per token and averages to TPOT.
                            token_times.extend([time.time()] * len(delta.token_ids))
                            streamed.extend(delta.token_ids)
                        # Each worker stamps its own copy of the request; gather the stages here.
                        request.times.update(delta.times)
                        if delta.finished:
                            finished = True
                            self._observe(decode, request.times, token_times, delta.finish_reason)
                        yield delta
                return
            except (WorkerDraining, ray.exceptions.RayActorError) as exc:
                # Before the first delta, only the prefill call (when there is one) has run.
                failed = prefill if prefill is not None and not token_times else decode
                if isinstance(exc, ray.exceptions.RayActorError):
                    self.view.lost(failed, type(exc).__name__)
                excluded.add(failed)
                failure = failed, exc
                if not token_times:
                    attempts += 1
                    logger.info("re-routing %s away from %s (attempt %d): %s", request.request_id, failed,
                                attempts, type(exc).__name__)
                    continue
                if migrations == self.migration_limit or not self.view.num_schedulable("decode"):
                    finished = True
                    yield self._give_up(request, decode, exc, token_times)
                    return
                migrations += 1
                migrating = True
                self.metrics.migrations.labels(failed).inc()
                logger.warning("migrating %s from %s after %d tokens (migration %d): %s", request.request_id,
                               failed, len(streamed), migrations, type(exc).__name__)
                block_hashes = self._resume(request, block_hashes, streamed)
            finally:
                self.view.end(decision, request.request_id)
                if not finished and not migrating and token_times:  # the client went away mid-stream
                    self._observe(decode, request.times, token_times, "abort")
        self.metrics.rejected.labels("no_decode_worker").inc()
        raise NoDecodeWorker(f"no worker could take the request in {self.max_attempts} attempts")

    def _resume(self, request: GenerateRequest, block_hashes: Sequence[int], streamed: list[int]) -> list[int]:
        """Make `request` continue after the tokens already streamed; returns the block hashes of its
        new context (prompt + those tokens), extending the prompt's."""
        request.output_token_ids = list(streamed)
        context = request.prompt_token_ids + request.output_token_ids
        return hashing.extend_block_hashes(list(block_hashes), context, self.view.block_size, request.cache_salt)

    def _give_up(self, request: GenerateRequest, worker: str, exc: Exception, token_times: list[float]) -> TokenDelta:
        """The last delta of a stream that cannot go on: finish_reason "error", naming the failed worker."""
        self._observe(worker, request.times, token_times, "error")
        return TokenDelta(request.request_id, [], "", finished=True, finish_reason="error",
                          error=f"worker {worker} failed mid-stream: {type(exc).__name__}")

    async def _route(self, request: GenerateRequest, block_hashes: Sequence[int], excluded: set[str]) -> RouteDecision:
        """Place the request. While the prefill queue is full and the remote path still meets the TTFT SLO,
        wait for a slot and route again; the policy turns to local prefill once waiting longer would miss
        the SLO, so the wait ends within ttft_slo_s of the request's arrival."""
        waited_since = None
        while True:
            try:
                # A migrated request prefills on its decode worker: a prefill worker hands over prompt KV only.
                decision = self.view.route(block_hashes, request.num_context_tokens, excluded,
                                           remote_prefill=not request.output_token_ids,
                                           elapsed_s=max(0.0, time.time() - request.times["arrival"]))
            except NoDecodeWorker:
                self.metrics.rejected.labels("no_decode_worker").inc()
                raise
            if not decision.wait:
                break
            waited_since = waited_since or time.monotonic()
            await self.view.wait_for_loads(PREFILL_SLOT_POLL_S)
        if waited_since is not None:
            self.metrics.prefill_queue_wait.labels("remote" if decision.prefill else "local").observe(
                time.monotonic() - waited_since)
        request.stamp("routed")
        self.view.begin(decision, request.request_id, request.num_context_tokens)
        return decision

    def _observe(self, worker: str, times: dict, token_times: list[float], finish_reason: str | None) -> None:
        self.metrics.observe_finished("decode", worker, times, token_times, finish_reason)
        self.latencies.add(times.get("arrival"), token_times)

