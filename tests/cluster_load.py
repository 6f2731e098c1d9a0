"""A load client for the scaling tests that routes the way the ingress does: workers come from the
controller's membership (ready, healthy, not draining), the one with the fewest outstanding requests
wins, and only a request a draining worker refused before its first token is sent elsewhere. Any
other error is a failed request."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from engine import SamplingParams
from engine.protocol import GenerateRequest
from engine.serving import WorkerDraining
from router.dispatch import run_request


@dataclass(slots=True)
class Outcome:
    request_id: str
    started: float
    decode: str | None = None
    prefill: str | None = None
    finished: float = 0.0
    num_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    reroutes: int = 0
    token_times: list[float] = field(default_factory=list)


class LoadClient:
    """Sends requests to the cluster behind `controller`; `report_latencies` feeds the controller the
    TTFT and ITL samples the ingress would report."""

    def __init__(self, controller, seed: int = 0, max_tokens: tuple[int, int] = (16, 48),
                 report_latencies: bool = False):
        self.controller = controller
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.report_latencies = report_latencies
        self.outstanding: dict[str, int] = {}
        self.actors: dict[str, object] = {}  # every worker the client has seen, by id
        self.outcomes: list[Outcome] = []

    async def run(self, stop: asyncio.Event, max_requests: int, interval_s: float,
                  max_in_flight: int | None = None) -> list[Outcome]:
        """Start a request every `interval_s` until `stop` is set or `max_requests` were sent; wait for all.
        With `max_in_flight`, a new request waits for a slot, so a slow machine is not buried in work."""
        tasks = []
        slots = asyncio.Semaphore(max_in_flight or max_requests)
        for i in range(max_requests):
            await slots.acquire()
            if stop.is_set():
                break
            task = asyncio.create_task(self.one(f"load-{id(self)}-{i}"))
            task.add_done_callback(lambda _: slots.release())
            tasks.append(task)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*tasks)
        return self.outcomes

    async def one(self, request_id: str) -> Outcome:
        prompt = [self.rng.randrange(3, 1000) for _ in range(self.rng.randrange(5, 60))]
        n = self.rng.randrange(*self.max_tokens)
        outcome = Outcome(request_id, time.time(), max_tokens=n)
        self.outcomes.append(outcome)
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        while True:
            decode, prefill = await self._pick()
            outcome.decode, outcome.prefill = decode[0], prefill[0] if prefill else None
            request = GenerateRequest(f"{request_id}-{outcome.reroutes}", prompt, params)
            for wid in (decode[0], prefill[0] if prefill else None):
                if wid:
                    self.outstanding[wid] = self.outstanding.get(wid, 0) + 1
            try:
                async for delta in run_request(request, decode[1], prefill[1] if prefill else None):
                    outcome.token_times.extend([time.time()] * len(delta.token_ids))
                    outcome.num_tokens += len(delta.token_ids)
                    outcome.finish_reason = delta.finish_reason if delta.finished else None
                break
            except WorkerDraining:
                if outcome.num_tokens or outcome.reroutes >= 5:
                    outcome.error = "WorkerDraining after tokens were streamed"
                    break
                outcome.reroutes += 1
            except Exception as exc:  # noqa: BLE001 - every other error is what the test counts
                outcome.error = f"{type(exc).__name__}: {exc}"
                break
            finally:
                for wid in (decode[0], prefill[0] if prefill else None):
                    if wid:
                        self.outstanding[wid] -= 1
        outcome.finished = time.time()
        if self.report_latencies and outcome.token_times:
            times = outcome.token_times
            gaps = [b - a for a, b in zip(times, times[1:])]
            self.controller.report_latencies.remote([times[0] - outcome.started], gaps)
        return outcome

    async def _pick(self):
        membership = await self.controller.membership.remote()
        self.actors.update((w.worker_id, w.actor) for w in membership.workers)
        usable = [w for w in membership.workers if w.healthy and not w.draining]

        def least_loaded(pool):
            candidates = [w for w in usable if w.pool == pool]
            if not candidates:
                return None
            self.rng.shuffle(candidates)
            w = min(candidates, key=lambda w: self.outstanding.get(w.worker_id, 0))
            return w.worker_id, w.actor

        return least_loaded("decode"), least_loaded("prefill")


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    """Requests that did not finish normally with all their tokens."""
    return [o for o in outcomes if o.error or o.finish_reason not in ("length", "stop")
            or (o.finish_reason == "length" and o.num_tokens != o.max_tokens)]
