"""A worker's KV-event long poll sleeps until the engine thread publishes a batch, or until its timeout: it does
not wake every few milliseconds to look (each router polls each worker, and on CPU those wake-ups preempted
the forwards on the worker's core)."""
from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig, SamplingParams
from worker_runtime.protocol import GenerateRequest
from worker_runtime.serving import EngineServer

PROMPT = [5, 17, 42, 99, 123, 7, 64, 250, 31, 8, 77, 3, 19, 200, 11, 45, 90]  # fills a 16-token block


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = EngineServer("events-0", EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
    yield server
    server.loop.stop()


def test_the_poll_wakes_when_a_batch_is_published_and_never_polls(server, monkeypatch):
    real_sleep = asyncio.sleep
    sleeps = []

    async def counting_sleep(delay, *args, **kwargs):
        sleeps.append(delay)
        return await real_sleep(delay, *args, **kwargs)

    async def run():
        after = server.events.seq
        poll = asyncio.ensure_future(server.kv_events(after, timeout_s=120.0))
        await real_sleep(0.2)
        assert not poll.done(), "returned before anything was published"
        monkeypatch.setattr(asyncio, "sleep", counting_sleep)
        request = GenerateRequest("events-1", PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
        async for _ in server.stream(request, server.build_request(request)):
            pass
        reply = await asyncio.wait_for(poll, 120.0)
        return after, reply

    after, reply = asyncio.run(run())
    assert reply.batches, "woke without the published batch"
    assert reply.batches[0].seq == after + 1 and reply.seq >= after + 1
    assert any(event.kind == "stored" for batch in reply.batches for event in batch.events)
    assert sleeps == []  # the poll slept on the publish, not in a loop
    assert not server.event_waiters


def test_a_poll_with_nothing_published_returns_empty_at_its_timeout(server):
    seq = server.events.seq
    reply = asyncio.run(server.kv_events(seq, timeout_s=0.1))
    assert reply.batches == [] and reply.snapshot is None and reply.seq == seq
    assert not server.event_waiters


def test_a_batch_published_before_the_poll_returns_at_once(server):
    async def run():
        after = server.events.seq
        request = GenerateRequest("events-2", [p + 1 for p in PROMPT], SamplingParams(temperature=0.0, max_tokens=2))
        async for _ in server.stream(request, server.build_request(request)):
            pass
        await server.loop.run(lambda: None)  # the step's publish has happened
        return after, await asyncio.wait_for(server.kv_events(after, timeout_s=120.0), 120.0)

    after, reply = asyncio.run(run())
    assert reply.batches and reply.batches[0].seq == after + 1
