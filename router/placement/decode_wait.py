"""A request's wait for a schedulable decode worker while the pool can heal (Ray restarting a crashed worker
in place, the controller replacing a dead one), bounded, and counted by how it ended
(tandem:decode_worker_waits)."""
from __future__ import annotations

import logging
import time

from router.metrics import Metrics
from router.placement.worker_view import WorkerView
from worker_runtime.protocol import GenerateRequest

logger = logging.getLogger(__name__)

# A waiting request routes again this often at least (every membership change and load report wakes it).
DECODE_WAIT_POLL_S = 0.5


class DecodeWait:
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
