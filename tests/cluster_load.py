"""Load through what users run: a tandem app assembled by `cluster.app.build_app` on a real Serve instance,
and a client that streams completions to it over HTTP. Routing, retries on a draining worker and
migration are the ingress's; the client only counts what it receives. Worker-side facts (which worker
had requests in flight, which served any) are read from the workers' own stats."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp
import ray

from tests.helpers import free_port


@dataclass(slots=True)
class Outcome:
    request_id: str
    started: float
    finished: float = 0.0
    num_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    token_times: list[float] = field(default_factory=list)


@contextmanager
def serve_tandem(config) -> Iterator[str]:
    """Serve `config` through `cluster.app:build_app` on a free loopback port (on the session's Ray);
    yields the base URL; stops the app and its cluster afterwards."""
    from ray import serve

    from cluster.app import build_app, shutdown_cluster

    port = free_port()
    try:
        # The apps first: their cluster controllers start the workers, which load while Serve starts.
        app = build_app(config)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name=config.name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        shutdown_cluster(config.name, config.namespace)


class LoadClient:
    """Streams greedy completions of random token-id prompts to `base_url`, one every `interval_s`."""

    def __init__(self, base_url: str, model: str, seed: int = 0, max_tokens: tuple[int, int] = (16, 48)):
        self.base_url = base_url
        self.model = model
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []

    async def run(self, stop: asyncio.Event, max_requests: int, interval_s: float,
                  max_in_flight: int | None = None) -> list[Outcome]:
        """Start a request every `interval_s` until `stop` is set or `max_requests` were sent; wait for all.
        With `max_in_flight`, a new request waits for a slot, so a slow machine is not buried in work."""
        tasks = []
        slots = asyncio.Semaphore(max_in_flight or max_requests)
        connector = aiohttp.TCPConnector(limit=max_in_flight or 100)
        async with aiohttp.ClientSession(self.base_url, connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=300)) as http:
            for i in range(max_requests):
                await slots.acquire()
                if stop.is_set():
                    break
                task = asyncio.create_task(self.one(http, f"load-{id(self)}-{i}"))
                task.add_done_callback(lambda _: slots.release())
                tasks.append(task)
                try:
                    await asyncio.wait_for(stop.wait(), interval_s)
                except asyncio.TimeoutError:
                    pass
            await asyncio.gather(*tasks)
        return self.outcomes

    async def one(self, http: aiohttp.ClientSession, request_id: str) -> Outcome:
        prompt = [self.rng.randrange(3, 1000) for _ in range(self.rng.randrange(5, 60))]
        n = self.rng.randrange(*self.max_tokens)
        outcome = Outcome(request_id, time.time(), max_tokens=n)
        self.outcomes.append(outcome)
        body = {"model": self.model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with http.post("/v1/completions", json=body) as response:
                if response.status != 200:
                    outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                else:
                    await self._read(response, outcome)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.finished = time.time()
        return outcome

    @staticmethod
    async def _read(response: aiohttp.ClientResponse, outcome: Outcome) -> None:
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                outcome.error = f"error event: {event['error'].get('message')}"
                continue
            for choice in event.get("choices", []):
                if choice.get("text"):
                    outcome.token_times.append(time.time())
                if choice.get("finish_reason"):
                    outcome.finish_reason = choice["finish_reason"]
            if event.get("usage"):
                outcome.num_tokens = event["usage"]["completion_tokens"]


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    """Requests that did not finish normally with all their tokens."""
    return [o for o in outcomes if o.error or o.finish_reason not in ("length", "stop")
            or (o.finish_reason == "length" and o.num_tokens != o.max_tokens)]


def in_flight(actor) -> int:
    """Requests a worker holds right now (0 for a dead one)."""
    try:
        return ray.get(actor.num_in_flight.remote(), timeout=10)
    except ray.exceptions.RayError:
        return 0


def has_served(actor) -> bool:
    """Whether a worker has computed any prompt or generated any token."""
    stats = ray.get(actor.stats.remote(), timeout=10)
    return stats.prompt_tokens > 0 or stats.generation_tokens > 0
