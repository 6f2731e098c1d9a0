"""A worker's request stream coalesces: a consumer that fell behind gets what accumulated since its last read
in one item, and the items add up to exactly what the offline engine produces token by token."""
from __future__ import annotations

import asyncio

import pytest

from engine import Engine, EngineConfig, SamplingParams
from worker_runtime.protocol import GenerateRequest
from worker_runtime.serving import EngineServer
from tests.helpers import wait_for_async

PROMPT = [5, 17, 42, 99, 123, 7, 64, 250, 31, 8]
GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = EngineServer("coalesce-0", EngineConfig(model=tiny_llama_dir, num_kv_blocks=128))
    yield server
    server.loop.stop()


def reference(server: EngineServer, params: SamplingParams, prompt: list[int] = PROMPT):
    """Token ids, text, finish_reason and logprobs of the offline engine, one step at a time. Runs as one
    command on the server's loop thread: only that thread may step the engine."""
    return server.loop.submit(_reference, server.engine, params, prompt).result(timeout=120)


def _reference(engine: Engine, params: SamplingParams, prompt: list[int]):
    engine.add_request("ref", prompt, params)
    ids, text, logprobs, reason = [], "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
            logprobs += out.new_logprobs
            reason = out.finish_reason
    return ids, text, reason, logprobs


def read_slowly(server: EngineServer, params: SamplingParams, request_id: str, prompt: list[int] = PROMPT) -> list:
    """Read the first output, then only once the request has finished and every output reached the queue."""
    async def run() -> list:
        request = GenerateRequest(request_id, prompt, params)
        engine_req = server.build_request(request)
        outputs = []
        async for out in server.stream(request, engine_req):
            outputs.append(out)
            if len(outputs) == 1:
                assert await wait_for_async(lambda: engine_req.finish_reason is not None)
                # The loop thread handed the last step's outputs over before it runs this command.
                await server.loop.run(lambda: None)
        return outputs

    return asyncio.run(run())


def test_a_consumer_that_fell_behind_gets_the_rest_in_one_item_equal_to_token_by_token(server, tiny_llama_dir):
    params = SamplingParams(**GREEDY, logprobs=2)
    outputs = read_slowly(server, params, "slow-0")
    assert len(outputs) == 2  # the first token, then the 23 that accumulated
    assert [len(o.new_token_ids) for o in outputs] == [1, 23]
    ids, text, reason, logprobs = reference(server, params)
    assert sum((o.new_token_ids for o in outputs), []) == ids
    assert "".join(o.new_text for o in outputs) == text
    assert sum((o.new_logprobs for o in outputs), []) == logprobs
    assert outputs[-1].finished and outputs[-1].finish_reason == reason == "length"


def test_a_stop_string_inside_coalesced_tokens_still_ends_the_text_before_it(server):
    _, text, _, _ = reference(server, SamplingParams(**GREEDY))
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(**GREEDY, stop=[stop])
    outputs = read_slowly(server, params, "slow-stop")
    ids, expected, reason, _ = reference(server, params)
    streamed = "".join(o.new_text for o in outputs)
    assert streamed == expected and stop not in streamed
    assert outputs[-1].finish_reason == reason == "stop" and outputs[-1].stop_reason == stop
    assert sum((o.new_token_ids for o in outputs), []) == ids


def test_coalesced_text_with_multibyte_characters_equals_token_by_token(server):
    # Prompts that make the tiny model emit byte-level pieces of non-ASCII characters (e.g. "ö"); which of
    # them does can change with the engine's threads (near-tied logits of random weights), so take the
    # first that does.
    params = SamplingParams(**{**GREEDY, "max_tokens": 48})
    for words in ("Grüße, 東京 🚀 東京", "東京 東京 東京 🚀🚀", "ÄÖÜ äöü ß é è ê", "🚀 Grüße 東京 ñ"):
        prompt = server.engine.tokenizer.encode(words)
        ids, text, _, _ = reference(server, params, prompt)
        if any(ord(c) > 127 and c != "\ufffd" for c in text):
            break
    else:
        pytest.fail("none of the prompts made the tiny model emit a multi-byte character")
    outputs = read_slowly(server, params, "slow-utf8", prompt)
    assert len(outputs) == 2
    assert "".join(o.new_text for o in outputs) == text
    assert sum((o.new_token_ids for o in outputs), []) == ids
