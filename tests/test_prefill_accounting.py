"""Each request counts the forwards that computed its prompt (chunks; those on borrowed cores) and their
seconds into its one timeline (the worker's GenerateRequest's, which the engine stamps), so a slow prefill
in a benchmark says whether it ran as one forward or many (bench/serve_metrics.py: slowest_ttfts)."""
from __future__ import annotations

import asyncio
import random

import pytest

from engine import EngineConfig, SamplingParams
from worker_runtime.protocol import GenerateRequest
from worker_runtime.serving import EngineServer

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # 16 tokens a step: a 40-token prompt takes three forwards.
    server = EngineServer("account-0", EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=16))
    yield server
    server.loop.stop()


def serve(server: EngineServer, request_id: str, num_prompt_tokens: int):
    async def run():
        rng = random.Random(request_id)  # no two tests share a prompt (nor a cached prefix)
        request = GenerateRequest(request_id, [rng.randrange(3, 200) for _ in range(num_prompt_tokens)], PARAMS)
        engine_req = server.build_request(request)
        deltas = [delta async for delta in (server.outgoing(out, request)
                                            async for out in server.stream(request, engine_req))]
        return engine_req, deltas

    return asyncio.run(run())


def test_a_chunked_prompt_counts_its_forwards_and_decode_steps_do_not(server):
    req, deltas = serve(server, "chunked", 40)
    assert sum(len(d.new_token_ids) for d in deltas) == PARAMS.max_tokens  # six tokens: five decode steps after
    assert (req.timeline.prefill_steps, req.timeline.prefill_borrowed_steps) == (3, 0)
    timeline = deltas[-1].timeline
    assert (timeline.prefill_steps, timeline.prefill_borrowed_steps) == (3, 0)
    assert 0 < timeline.prefill_forward_s < timeline.times["finished"] - timeline.times["arrival"]

    short, _ = serve(server, "one-forward", 10)
    assert short.timeline.prefill_steps == 1


def test_the_engine_stamps_the_served_request_timeline(server):
    """One timeline per request: the engine writes its first scheduling into the worker's request's."""
    req, deltas = serve(server, "stamped", 10)
    times = deltas[-1].timeline.times
    assert times["arrival"] <= times["prefill_started"] <= times["finished"]
    assert "decode_started" not in times  # its own prompt, not an imported one


def test_forwards_on_borrowed_cores_are_counted_apart(server):
    def borrow(on: bool) -> None:
        server.loop.step_context.borrowing = on  # what the engine loop sets from its PinnedCores before each step

    server.loop.submit(borrow, True).result(timeout=10)
    try:
        req, deltas = serve(server, "borrowed", 40)
    finally:
        server.loop.submit(borrow, False).result(timeout=10)
    assert (req.timeline.prefill_steps, req.timeline.prefill_borrowed_steps) == (3, 3)
    assert deltas[-1].timeline.prefill_borrowed_steps == 3
