"""bench/soak.py's traffic: a seeded plan of completions of many kinds, and a client that records how each
one ended. Requests go only to the soak's own server (127.0.0.1).

Kinds: `stream` and `complete` (non-streamed) run to their end; `abort` closes the stream after a few
chunks and `disconnect` right after the response starts (during prefill), as a client that goes away;
`timeout` gives the client a short deadline; `single` asks for one token (prefill only, nothing to pull).

Every request must end in a final event the client saw or caused: a finish_reason, an error event, an
HTTP error status, or the client's own close or deadline. A request that ends otherwise (the stream
stops without a finish_reason, the connection breaks, it outlives its generous deadline) is lost.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp

KINDS = {"stream": 0.40, "complete": 0.20, "abort": 0.15, "disconnect": 0.08, "timeout": 0.10, "single": 0.07}
CLIENT_ENDED = ("client_abort", "client_timeout")  # finals the client caused itself


@dataclass(slots=True)
class PlannedRequest:
    index: int
    kind: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    abort_after: int = 0  # `abort`: chunks read before closing
    client_timeout_s: float | None = None  # `timeout`: the client's own deadline


@dataclass(slots=True)
class Outcome:
    """How one request ended: `final` is a finish_reason, "http_<status>", "error_event", one of
    CLIENT_ENDED, or None (lost, with `detail` saying what happened instead)."""
    index: int
    kind: str
    final: str | None = None
    num_tokens: int | None = None
    max_tokens: int = 0
    detail: str = ""
    seconds: float = 0.0
    tenant: str = "soak"

    @property
    def wrong_length(self) -> bool:
        """A `length` finish whose usage reports another token count than max_tokens (ignore_eos is on)."""
        return self.final == "length" and self.num_tokens is not None and self.num_tokens != self.max_tokens


def plan(num_requests: int, seed: int) -> list[PlannedRequest]:
    """The soak's requests, the same for the same seed whatever the concurrency. About a third share one of
    four 48-token prefixes (prefix cache hits, cached blocks a new request reuses); prompts run up to ~120
    tokens, so with a local prefill limit below that many go to the prefill worker."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(48)] for _ in range(4)]
    kinds, weights = list(KINDS), list(KINDS.values())
    out = []
    for i in range(num_requests):
        kind = rng.choices(kinds, weights)[0]
        if rng.random() < 0.35:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))]
        else:
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 120))]
        sampled = rng.random() < 0.25
        out.append(PlannedRequest(i, kind, prompt, 1 if kind == "single" else rng.randrange(4, 48),
                                  0.8 if sampled else 0.0, rng.randrange(1 << 31) if sampled else None,
                                  abort_after=rng.randrange(1, 6) if kind == "abort" else 0,
                                  client_timeout_s=rng.uniform(0.05, 1.5) if kind == "timeout" else None))
    return out


def body(req: PlannedRequest, model: str) -> dict:
    stream = req.kind not in ("complete", "single")
    out = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": req.temperature,
           "ignore_eos": True, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    if req.seed is not None:
        out["seed"] = req.seed
    return out


async def send(http: aiohttp.ClientSession, model: str, req: PlannedRequest, timeout_s: float) -> Outcome:
    """Send one planned request and record how it ended; never raises (but for cancellation)."""
    outcome = Outcome(req.index, req.kind, max_tokens=req.max_tokens)
    start = time.monotonic()
    deadline = req.client_timeout_s or timeout_s
    try:
        async with asyncio.timeout(deadline):
            async with http.post("/v1/completions", json=body(req, model)) as response:
                if response.status != 200:
                    outcome.final = f"http_{response.status}"
                    outcome.detail = (await response.text())[:200]
                elif req.kind == "disconnect":
                    outcome.final = "client_abort"
                    response.close()
                elif body(req, model)["stream"]:
                    await _read_stream(response, req, outcome)
                else:
                    _read_completion(await response.json(), outcome)
    except TimeoutError:
        if outcome.final is None and req.client_timeout_s is not None:
            outcome.final = "client_timeout"
        elif outcome.final is None:
            outcome.detail = f"hung: no final event within {timeout_s:g} s"
    except (aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        if outcome.final is None:
            outcome.detail = f"{type(exc).__name__}: {exc}"
    outcome.seconds = time.monotonic() - start
    return outcome


async def sse_events(response: aiohttp.ClientResponse):
    """The JSON events of an OpenAI SSE stream, up to [DONE]."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


async def _read_stream(response: aiohttp.ClientResponse, req: PlannedRequest, outcome: Outcome) -> None:
    chunks = 0
    async for event in sse_events(response):
        if "error" in event:
            outcome.final, outcome.detail = "error_event", str(event["error"].get("message"))[:200]
            continue
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                outcome.final = choice["finish_reason"]
        if event.get("usage"):
            outcome.num_tokens = event["usage"]["completion_tokens"]
        chunks += bool(event.get("choices"))
        if req.kind == "abort" and chunks >= req.abort_after and outcome.final is None:
            outcome.final = "client_abort"
            response.close()
            return
    if outcome.final is None:
        outcome.detail = f"the stream ended after {chunks} chunks without a finish_reason"


def _read_completion(data: dict, outcome: Outcome) -> None:
    choices = data.get("choices") or []
    outcome.final = choices[0].get("finish_reason") if choices else None
    outcome.num_tokens = (data.get("usage") or {}).get("completion_tokens")
    if outcome.final is None:
        outcome.detail = f"a 200 response without a finish_reason: {json.dumps(data)[:200]}"


async def run_traffic(base_url: str, model: str, requests: list[PlannedRequest], concurrency: int,
                      timeout_s: float, on_done=None, api_key: str | None = None,
                      tenant: str = "soak", refused_pause_s: float = 0.0) -> list[Outcome]:
    """Send `requests` with at most `concurrency` in flight (with `api_key`, as that key's tenant);
    `on_done(outcome)` after each. A client slot refused with 429 or 503 waits `refused_pause_s` before its next
    request, as a client that backs off."""
    slots = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    # Each request's own deadline (asyncio.timeout in `send`) is the only one.
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                     headers=headers) as http:
        async def one(req: PlannedRequest) -> Outcome:
            async with slots:
                outcome = await send(http, model, req, timeout_s)
                if refused_pause_s and outcome.final in ("http_429", "http_503"):
                    await asyncio.sleep(refused_pause_s)
            outcome.tenant = tenant
            if on_done is not None:
                on_done(outcome)
            return outcome

        return list(await asyncio.gather(*(one(r) for r in requests)))
