"""Runs one sequence through the cluster: place it, run it, re-place it if its worker fails early.

A worker that is draining or dead before anything reached the client is excluded and the request is
placed again (a bounded number of times). Once tokens went out, the stream ends with finish_reason
"error": moving a half-generated request to another worker is future work (request migration).
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

import ray

from cluster.metrics import Metrics
from engine.protocol import GenerateRequest, TokenDelta
from engine.serving import WorkerDraining
from router.dispatch import run_request
from router.latency_report import LatencyReporter
from router.policy import NoDecodeWorker, RouteDecision
from router.worker_view import WorkerView

logger = logging.getLogger(__name__)


class RequestRouter:
    """Places and runs GenerateRequests, and observes each one's latencies when it ends."""

    def __init__(self, view: WorkerView, metrics: Metrics, latencies: LatencyReporter, max_attempts: int = 3):
        self.view = view
        self.metrics = metrics
        self.latencies = latencies
        self.max_attempts = max_attempts

    async def stream(self, request: GenerateRequest, block_hashes: Sequence[int]) -> AsyncIterator[TokenDelta]:
        """Yield the request's token deltas. Closing the iterator aborts it on every worker it runs on.

        Raises NoDecodeWorker when no decode worker can take it, and InvalidRequestError when a worker
        refuses it (both before anything was yielded)."""
        excluded: set[str] = set()
        token_times: list[float] = []
        for attempt in range(self.max_attempts):
            decision = self._route(request, block_hashes, excluded)
            decode = decision.decode.worker_id
            prefill = decision.prefill.worker_id if decision.prefill else None
            finished = False
            try:
                actors = self.view.actor(decode), prefill and self.view.actor(prefill)
                async with aclosing(run_request(request, *actors)) as deltas:
                    async for delta in deltas:
                        if delta.token_ids:
                            token_times.append(time.time())
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
                if token_times:
                    finished = True
                    self._observe(decode, request.times, token_times, "error")
                    yield _failed_delta(request, decision, exc)
                    return
                excluded.add(failed)
                logger.info("re-routing %s away from %s (attempt %d): %s", request.request_id, failed,
                            attempt + 1, type(exc).__name__)
            finally:
                self.view.end(decision, request.request_id)
                if not finished and token_times:  # the client went away mid-stream
                    self._observe(decode, request.times, token_times, "abort")
        self.metrics.rejected.labels("no_decode_worker").inc()
        raise NoDecodeWorker(f"no worker could take the request in {self.max_attempts} attempts")

    def _route(self, request: GenerateRequest, block_hashes: Sequence[int], excluded: set[str]) -> RouteDecision:
        try:
            decision = self.view.route(block_hashes, len(request.prompt_token_ids), excluded)
        except NoDecodeWorker:
            self.metrics.rejected.labels("no_decode_worker").inc()
            raise
        request.stamp("routed")
        self.view.begin(decision, request.request_id, len(request.prompt_token_ids))
        return decision

    def _observe(self, worker: str, times: dict, token_times: list[float], finish_reason: str | None) -> None:
        self.metrics.observe_finished("decode", worker, times, token_times, finish_reason)
        self.latencies.add(times.get("arrival"), token_times)


def _failed_delta(request: GenerateRequest, decision: RouteDecision, exc: Exception) -> TokenDelta:
    return TokenDelta(request.request_id, [], "", finished=True, finish_reason="error",
                      error=f"worker {decision.decode.worker_id} failed mid-stream: {type(exc).__name__}")
