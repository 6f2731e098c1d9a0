"""bench/serve.py's HTTP side: stream requests to an OpenAI-compatible server and time them, and read
its Prometheus counters. Requests go only to the target's base URL; each has a deadline, and
whatever goes wrong ends the request as a counted failure, never the run."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from bench.serve_data import Session
from bench.serve_metrics import RequestResult

# vLLM's per-request phase histograms (seconds); their _sum and _count give a run's mean per phase.
VLLM_PHASE_HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                         "TTFT": "vllm:time_to_first_token_seconds"}
SCRAPED_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                    "tandem:prefills", "tandem:kv_transfer_failures", "tandem:routing_decisions",
                    "tandem:flow_admitted_requests", "tandem:flow_ahead_requests", "tandem:flow_quick_requests",
                    *(f"{name}_{part}" for name in VLLM_PHASE_HISTOGRAMS.values() for part in ("sum", "count")))


@dataclass(slots=True)
class Target:
    """Where and how requests go."""
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)
    extra_headers: dict = field(default_factory=dict)

    def headers(self) -> dict:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**auth, **self.extra_headers}


def request_body(target: Target, turn, messages: list[dict] | None) -> dict:
    body = {"model": target.model, "max_tokens": turn.output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = turn.prompt_token_ids
    body.update(target.extra_body)
    return body


def chunk_text(chunk: dict) -> str:
    """The generated text a completions or chat SSE chunk carries ("" for role-only or usage chunks)."""
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send_request(http: aiohttp.ClientSession, target: Target, turn, messages: list[dict] | None,
                       result: RequestResult) -> str:
    """Streams one request into `result`; returns the generated text (for the next chat turn)."""
    start = time.perf_counter()
    last = start
    texts: list[str] = []
    chunks_with_text = 0
    usage_tokens = None
    done = False
    try:
        timeout = aiohttp.ClientTimeout(total=target.timeout_s)
        async with http.post(target.base_url + target.endpoint, json=request_body(target, turn, messages),
                             headers=target.headers(), timeout=timeout) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return ""
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {str(chunk['error'])[:200]}"
                    return ""
                now = time.perf_counter()
                if text := chunk_text(chunk):
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks_with_text += 1
                    texts.append(text)
                if timelines := (chunk.get("tandem") or {}).get("timelines"):
                    result.timeline = timelines[0]
                for choice in chunk.get("choices") or []:
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    # A chat turn's prompt is the whole conversation in the chat template: the server counts it.
                    result.prompt_len = chunk["usage"].get("prompt_tokens") or result.prompt_len
    except asyncio.TimeoutError:
        result.error = f"timeout after {target.timeout_s:g} s"
        return ""
    except Exception as exc:  # noqa: BLE001 -- whatever goes wrong, the request ends counted as failed
        result.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        return ""
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks_with_text
    result.e2e = last - start
    if not done:
        result.error = "stream ended without [DONE]"
    elif result.finish_reason in ("abort", "error"):
        result.error = f"finish_reason {result.finish_reason}"
    elif chunks_with_text == 0:
        result.error = "no tokens"
    else:
        result.success = True
    return "".join(texts)


async def run_session(http, target: Target, session: Session, run_start: float, limiter, results: list,
                      progress) -> None:
    """The session's turns in order; a chat turn carries the conversation so far. A turn after a failed
    one is not sent and counts as failed, so every planned request ends in the results."""
    await asyncio.sleep(max(0.0, run_start + session.arrival - time.perf_counter()))
    messages: list[dict] = []
    failed = False
    for turn in session.turns:
        result = RequestResult(session.kind, turn.prompt_len, turn.output_len)
        results.append(result)
        if failed:
            result.error = "an earlier turn of its conversation failed"
        else:
            if turn.is_chat:
                messages.append({"role": "user", "content": turn.user_text})
            async with limiter:
                result.arrival = time.perf_counter() - run_start
                reply = await send_request(http, target, turn, messages if turn.is_chat else None, result)
            if turn.is_chat:
                messages.append({"role": "assistant", "content": reply})
            failed = not result.success
        if progress is not None:
            progress.update(1)


class _NoLimit:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


async def run_workload(target: Target, sessions: list[Session], max_concurrency: int | None = None,
                       show_progress: bool = True) -> tuple[list[RequestResult], float]:
    """Sends every session at its arrival time; returns the per-request results and the run's duration."""
    total = sum(len(s.turns) for s in sessions)
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=total, desc="requests", file=sys.stderr)
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else _NoLimit()
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()
        await asyncio.gather(*(run_session(http, target, s, start, limiter, results, progress) for s in sessions))
        duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return results, duration


async def fetch_models(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(base_url + "/v1/models", headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            resp.raise_for_status()
            return [m["id"] for m in (await resp.json())["data"]]


def parse_counters(text: str, names=SCRAPED_COUNTERS) -> dict[str, float]:
    """Prometheus text → {series: value} for the counters named (with or without `_total`)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        base = name[:-len("_total")] if name.endswith("_total") else name
        if base in names:
            out[series] = out.get(series, 0.0) + float(value)
    return out


async def scrape_counters(base_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The server's counters of interest from /metrics, or None where it has none."""
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return parse_counters(await resp.text()) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def counter_deltas(before: dict | None, after: dict | None) -> dict:
    """Per-series increase over the run, and the prefix hit rate over all workers where both counters exist."""
    if before is None or after is None:
        return {}
    deltas = {k: v - before.get(k, 0.0) for k, v in after.items()}
    totals = {}
    for series, v in deltas.items():
        base = series.split("{", 1)[0].removesuffix("_total")
        totals[base] = totals.get(base, 0.0) + v
    out = {"series": deltas, "totals": totals}
    if totals.get("vllm:prefix_cache_queries"):
        out["prefix_hit_rate"] = totals.get("vllm:prefix_cache_hits", 0.0) / totals["vllm:prefix_cache_queries"]
    return out
