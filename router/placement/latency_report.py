"""Sends the latencies this replica observed to the controller, whose autoscaler scales on them."""
from __future__ import annotations

import asyncio
import logging

import ray

logger = logging.getLogger(__name__)


class LatencyReporter:
    """Batches each finished request's TTFT and inter-token gaps, and flushes them every `interval_s`.
    Bounded: while the controller is unreachable, the oldest samples are dropped."""

    def __init__(self, controller, interval_s: float = 1.0, max_samples: int = 10_000):
        self.controller = controller
        self.interval_s = interval_s
        self.max_samples = max_samples
        self.ttft_s: list[float] = []
        self.itl_s: list[float] = []

    def add(self, arrival: float | None, token_times: list[float]) -> None:
        if arrival is None or not token_times:
            return
        self.ttft_s.append(token_times[0] - arrival)
        self.itl_s.extend(b - a for a, b in zip(token_times, token_times[1:]))
        del self.ttft_s[:-self.max_samples], self.itl_s[:-self.max_samples]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.ttft_s and not self.itl_s:
                continue
            ttft, itl = self.ttft_s, self.itl_s
            self.ttft_s, self.itl_s = [], []
            try:
                await self.controller.report_latencies.remote(ttft, itl)
            except ray.exceptions.RayError as exc:
                logger.warning("could not report latencies to the controller: %s", exc)
